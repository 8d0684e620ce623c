"""stalwart's benchmarks: ``python -m benchmarks [NAME ...] [--json] [--quick]``.

Every benchmark measures stalwart and, in the same run on the same machine, the physical
limit or a peer, and reports the ratios and whether each goal is met (``docs/performance.md``).
Benchmarks live in one module per area (``store.py``, ...) and register themselves with
:func:`benchmarks._registry.benchmark`; to add an area, write the module and add its name
to :data:`benchmarks._registry.MODULES` (the registry's docstring shows an example).
"""
