"""The fit loop: train for the run's steps, evaluate after every epoch, checkpoint,
record what happened.

    programs = build_programs(...)                     # jaxcnn.build: one per batch size
    state = programs[batch].init()
    result = fit(programs, state, Loader(train_set), test_set, train_config)

Batches come from the data package's `Loader` (a grain pipeline over the whole run: order,
read, augment, prefetch), or from the training set held on the devices; either is a `Feed`
(jaxcnn.data.feed) handing the loop a call at a time. Progress is a bar on a terminal and
one line per epoch in a log. Under `jaxcnn.stopping.stop_requests`, a Ctrl-C or SIGTERM
stops the run at a step every process agrees on: the state is saved (`Interrupted`) and
the run can continue from it exactly.

Where each concern lives: loop.py (`fit` and an epoch), metrics.py (metrics to the host,
the non-finite check), history.py (losses, accuracies, epoch rows, a checkpoint's
record), actions.py (when to save, the stop, progress, the user's step callback),
clock.py (throughput, the input stall), evaluation.py, result.py.
"""

from jaxcnn.fit.actions import StepCallback, epoch_line
from jaxcnn.fit.evaluation import Evaluation, eval_share, evaluate
from jaxcnn.fit.loop import fit
from jaxcnn.fit.metrics import NONFINITE_CHECK_STEPS, NonFiniteLoss
from jaxcnn.fit.result import FitResult, Interrupted, diverged_at
from jaxcnn.resume import Resume

__all__ = [
    "NONFINITE_CHECK_STEPS",
    "Evaluation",
    "FitResult",
    "Interrupted",
    "NonFiniteLoss",
    "Resume",
    "StepCallback",
    "diverged_at",
    "epoch_line",
    "eval_share",
    "evaluate",
    "fit",
]
