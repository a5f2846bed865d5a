"""Benchmarks that train: `fit` against a bare loop over the same compiled call (loop.py,
`jaxcnn bench-loop`), and jaxcnn's models in PyTorch with the same weights, for comparing
backends side by side (torch_twin.py, experiments/compare_backends.py). Unlike
jaxcnn.analysis, which reads compiled programs back, these run the training path; the
training path never imports them (tests/test_structure.py)."""
