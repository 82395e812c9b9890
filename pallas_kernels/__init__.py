"""Pallas kernels of specjax. Each kernel file holds the kernel, its jitted wrapper (with an
`interpret` switch for CPU) and a pure-jnp `*_reference` the tests compare it against."""
