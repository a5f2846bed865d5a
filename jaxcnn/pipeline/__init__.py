"""Pipeline parallelism: where the model is cut (split), the order stages run in
(schedule), the per-stage programs behind one Program (program)."""

from jaxcnn.pipeline.program import PER_MICROBATCH, build_pipeline_program

__all__ = ["PER_MICROBATCH", "build_pipeline_program"]
