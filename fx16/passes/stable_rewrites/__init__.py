"""The rules of ``StabilizePass``: each matches one pattern 16-bit spoils and builds an
equivalent that computes well in it (its docstring shows before and after; ``marks``:
the meta markers its replacement writes). One family per module - ``norms``,
``magnitude``, ``logs``, ``gelu`` - and what they share, with the ``StableRewrite``
protocol, in ``matching``; ``fx16.passes.stabilize.standard_rules`` lists them in order."""
