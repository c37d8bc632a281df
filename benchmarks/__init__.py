"""Side-by-side measurements of fx16 and its peers. Run each as ``python -m benchmarks.<name>``."""
