"""Let a plain Python object holding device values live across CuTe DSL control flow.

A dynamic `if`/loop must yield every value its body may change. Objects that bundle such values
(register tensors, scalars) declare them in `_dynamic_fields`; this mixin flattens them to MLIR
values and rebuilds a shallow copy of the object around the new values. Other attributes are
compile-time constants and are carried over unchanged.
"""

import copy

import cutlass


class DynamicState:
    _dynamic_fields: tuple = ()

    def __extract_mlir_values__(self):
        values, self._value_counts = [], []
        for name in self._dynamic_fields:
            v = cutlass.extract_mlir_values(getattr(self, name))
            values += v
            self._value_counts.append(len(v))
        return values

    def __new_from_mlir_values__(self, values):
        obj = copy.copy(self)
        values = list(values)
        for name, n in zip(self._dynamic_fields, self._value_counts):
            setattr(obj, name, cutlass.new_from_mlir_values(getattr(self, name), values[:n]))
            values = values[n:]
        return obj
