"""Reading compiled programs back, and judging them: the collectives in the HLO (hlo),
what a step costs each device (cost), what theory says it should move (comm_model),
whether a placement did what its table meant (lint), hardware profiles and the layout
planner, the compare measurement, scaling verdicts and the step profiler. Nothing in
jaxcnn's training path imports this package."""
