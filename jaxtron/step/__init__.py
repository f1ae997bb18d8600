"""The train step: the loss and its gradient over microbatches, the pure step and its compilation
(train_step.py), the train state and its plan (state.py) and the optimizer (optim.py)."""

from jaxtron.step.train_step import (  # noqa: F401 - the names callers take from the package
    BATCH_KEYS,
    abstract_batch,
    check_segments,
    compile_eval,
    compile_step,
    empty_histories,
    evaluate,
    global_batch,
    loss_and_grads,
    loss_sums,
)
