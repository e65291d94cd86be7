"""Session: a plain PyTorch loop made elastic with about ten added lines.

::

    from elastrain.session import Session

    with Session(model, optimizer, dataset, global_batch=64, micro_batch=8, collate_fn=collate,
                 max_steps=1000, save_every_steps=50) as session:
        for step in session:                      # until max_steps / epochs
            for mb in step:                       # this rank's micro-batches; DDP no_sync handled
                loss = session.model(**mb.data).loss
                step.backward(loss, mb)           # scaled: the gradient is the global batch's mean
            step.optimizer_step()                 # LR, optimizer, data cursor, checkpoint, metrics
            step.log(loss=loss.item())

The session initialises the process group (gloo on CPU, nccl on GPU, with the launcher's collective
timeout), wraps the model in DDP, plans the batch with a scaling policy, feeds a ``DataLoader``
through an :class:`~elastrain.data.ElasticSampler`, restores the newest checkpoint, and after every
optimizer step advances the train state, saves when due (or when the launcher asks) and writes the
events and metrics files. The model is yours: anything whose batches come out of a ``collate_fn``.
The settings are one frozen, validated :class:`SessionConfig` (pass them as keywords, or build the
config once and pass ``config=``); a bad one is refused with one line naming it.

Under ``elastrain-run --live true`` a membership change does not restart the session's process: it
gives up the step in flight (or finishes it, when nodes only joined), joins the new round's process
group, agrees with the other members on one state (broadcast from a member, no checkpoint read) and
goes on; see :mod:`elastrain.live`. The parts are in :mod:`elastrain.session.loop`'s docstring.
"""

from elastrain.session.config import (
    CheckpointSettings,
    DataConfig,
    OutputConfig,
    RuntimeConfig,
    SessionConfig,
    SessionSettings,
)
from elastrain.session.errors import SessionConfigError, SessionError
from elastrain.session.loop import Session
from elastrain.session.step import MicroBatch, Step, move_to

__all__ = [
    "CheckpointSettings",
    "DataConfig",
    "MicroBatch",
    "OutputConfig",
    "RuntimeConfig",
    "Session",
    "SessionConfig",
    "SessionConfigError",
    "SessionError",
    "SessionSettings",
    "Step",
    "move_to",
]
