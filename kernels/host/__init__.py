"""Host-side Python shared by the kernel families: variant choice, launch planning and the
compile-time analysis of mods. Nothing here emits device code (CuTe DSL is imported only where a
compile needs stand-in tensors)."""
