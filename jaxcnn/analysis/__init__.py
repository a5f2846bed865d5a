"""Reading compiled programs back, and judging them: the collectives in the HLO (hlo),
what a step costs each device (cost), what theory says it should move (comm_model),
whether a placement did what its table meant (lint), hardware profiles and the layout
planner, the compare measurement, scaling verdicts and the step profiler. The training
path (build, spmd, pipeline, fit, steps) never imports this package; `jaxcnn.run` uses it
for --auto-batch and --print-shardings (tests/test_structure.py)."""
