"""Where elastrain hooks into transformers' ``Trainer``: a few methods wrapped, each delegating to the driver.

Every wrapper calls the original; with no driver attached (not under elastrain-run, or the integration
turned off) it is the original. Wrapped, for the transformers versions in :data:`~elastrain.integrations.
trainer.hook.TESTED` only:

* ``TrainingArguments._setup_devices``: in live mode a worker sets up as one process until ``train()``, where it
  joins its round's training group and accelerate's view is made again over it (a Trainer that cannot regroup in
  place joins here, as in restart mode);
* ``Trainer.__init__``: attaches the :class:`~elastrain.integrations.trainer.driver.ElasticTrainer`;
* ``Trainer.train``: the driver's loop (resume, regroups); ``Trainer.evaluate`` and ``Trainer.predict`` before it,
  and the DataLoaders they build (``get_eval_dataloader``, ``get_test_dataloader``: a subclass's own evaluation calls
  them): the job's first round joined there
  (:meth:`~elastrain.integrations.trainer.driver.ElasticTrainer.before_evaluation`);
* ``Trainer.get_train_dataloader``: the stream's batches for this rank; ``Trainer.set_initial_training_values``:
  the stream's epochs;
* ``Trainer._init_training_state``: the state in memory after a regroup;
* ``Trainer._prepare_for_training``: the step flags on DDP's gradient sync, the scheduler's kept state;
* ``Trainer._save_checkpoint``: the commit protocol prepares the folder (a world that lost the root writes nothing;
  a cut-short save's leftover is removed; a committed folder is never written again);
* ``Trainer.training_step`` and ``Trainer._maybe_log_save_evaluate``: the logging window's loss kept, so that a log
  the last world lost is written in the next (:mod:`~elastrain.integrations.trainer.lost_log`), and what the step's
  evaluation and save are due to do, so that the next world runs them if they were cut short
  (:mod:`~elastrain.integrations.trainer.lost_epilogue`); and a lost step's
  finished micro-batches noted (``Trainer.compute_loss`` too: the loss of a micro-batch whose gradient sync broke), and
  not run again in the next world (:mod:`~elastrain.integrations.trainer.kept_grads`);
* ``trainer_utils.get_last_checkpoint``: the newest *committed* checkpoint.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from elastrain.integrations.trainer.checkpoints import newest_committed
from elastrain.integrations.trainer.driver import ElasticTrainer, driver_of
from elastrain.integrations.trainer.membership import (
    WARM_UNSUPPORTED_EXIT,
    TrainerMembership,
    backend_for,
    provisional_environ,
    restart_only,
)
from elastrain.log import lifecycle

_patched: set[tuple[int, str]] = set()  # (id of the class or module, attribute) already wrapped


def _wrap(owner: Any, name: str, make: Any) -> None:
    """Replace ``owner.name`` by ``make(original)``, once."""
    key = (id(owner), name)
    if key in _patched:
        return
    _patched.add(key)
    setattr(owner, name, make(owner.__dict__[name]))


def patch_training_args(module: Any) -> None:
    cls = module.TrainingArguments
    key = (id(cls), "_setup_devices")
    if key in _patched:
        return
    _patched.add(key)
    original = cls.__dict__["_setup_devices"].func

    @functools.wraps(original)
    def _setup_devices(self: Any) -> Any:
        membership = TrainerMembership.of_process()
        if membership is None or membership.joined:
            return original(self)
        why_not_live = restart_only(self)
        if why_not_live is not None:
            if membership.warm:  # it never waits for a round: end, so that the agent starts it after the rendezvous
                lifecycle(
                    "trainer_warm_unsupported",
                    level=logging.WARNING,
                    why=f"{why_not_live}: the Trainer restarts at every change; its workers start after the rendezvous",
                )
                raise SystemExit(WARM_UNSUPPORTED_EXIT)
            membership.join(backend_for(self), compiles=bool(self.torch_compile))
            return original(self)
        # Until train(): a warm worker has no round yet, and a cold one (a restarted worker) would meet the members
        # that train on in the script's own setup collectives (main_process_first's barriers), which they never run.
        # Each sets up alone and joins its round where training starts.
        why = "a warm worker waits for a round" if membership.warm else "a cold worker joins its round"
        lifecycle("trainer_provisional", why=why + ", as one process until train()")
        with provisional_environ():
            return original(self)

    replacement = functools.cached_property(_setup_devices)
    replacement.__set_name__(cls, "_setup_devices")
    cls._setup_devices = replacement


def patch_trainer(module: Any) -> None:
    cls = module.Trainer

    def make_init(original: Any) -> Any:
        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if driver_of(self) is None:
                ElasticTrainer(self, TrainerMembership.of_process())

        return __init__

    def make_train(original: Any) -> Any:
        @functools.wraps(original)
        def train(self: Any, resume_from_checkpoint: Any = None, **kwargs: Any) -> Any:
            driver = driver_of(self)
            if driver is None:
                return original(self, resume_from_checkpoint=resume_from_checkpoint, **kwargs)
            return driver.train(original, resume_from_checkpoint, kwargs)

        return train

    def make_log(original: Any) -> Any:
        @functools.wraps(original)
        def _maybe_log_save_evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
            driver = driver_of(self)
            if driver is None or driver.world is None:
                return original(self, *args, **kwargs)
            driver.epilogue.entering(self)
            try:
                result = original(self, *args, **kwargs)
            finally:
                driver.lost_log.logged(self)
            driver.epilogue.returned()
            return result

        return _maybe_log_save_evaluate

    def make_save(original: Any) -> Any:
        @functools.wraps(original)
        def _save_checkpoint(self: Any, model: Any, trial: Any) -> Any:
            driver = driver_of(self)
            if driver is not None and not driver.checkpoints.prepare(int(self.state.global_step)):
                return None  # committed before: never written again
            return original(self, model, trial)

        return _save_checkpoint

    def make_training_step(original: Any) -> Any:
        @functools.wraps(original)
        def training_step(self: Any, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            driver = driver_of(self)
            if driver is None or driver.world is None:
                return original(self, model, inputs, num_items_in_batch)
            loss = driver.kept.restored(num_items_in_batch)  # a lost step's micro-batch this rank kept
            if loss is None:
                driver.kept.starting(num_items_in_batch)
                loss = original(self, model, inputs, num_items_in_batch)
            driver.kept.finished(loss)
            driver.lost_log.add(loss)
            return loss

        return training_step

    def make_loop(original: Any, loop: str = "") -> Any:
        name = loop or original.__name__

        @functools.wraps(original)
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            driver = driver_of(self)
            if driver is not None:
                driver.before_evaluation(name)
            return original(self, *args, **kwargs)

        return wrapped

    def make_compute_loss(original: Any) -> Any:
        @functools.wraps(original)
        def compute_loss(
            self: Any, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            result = original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            driver = driver_of(self)
            if driver is not None and driver.world is not None:
                driver.kept.computed(result[0] if return_outputs else result)
            return result

        return compute_loss

    def make_dataloader(original: Any) -> Any:
        @functools.wraps(original)
        def get_train_dataloader(self: Any) -> Any:
            driver = driver_of(self)
            if driver is None or not driver.loader.stream_ok():
                return original(self)
            return driver.loader.train_dataloader()

        return get_train_dataloader

    def make_init_state(original: Any) -> Any:
        @functools.wraps(original)
        def _init_training_state(self: Any, max_steps: Any, per_epoch: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, max_steps, per_epoch, *args, **kwargs)
            driver = driver_of(self)
            return result if driver is None else driver.init_training_state(result, int(max_steps), int(per_epoch))

        return _init_training_state

    def make_initial_values(original: Any) -> Any:
        @functools.wraps(original)
        def set_initial_training_values(self: Any, args: Any, dataloader: Any) -> Any:
            values = original(self, args, dataloader)
            driver = driver_of(self)
            if driver is None:
                return values
            driver.loader.check_own()
            epochs = driver.loader.epochs(int(values[-1]))
            return values if epochs is None else (epochs[1], *values[1:])  # the stream's epochs, not one

        return set_initial_training_values

    def make_prepare(original: Any) -> Any:
        @functools.wraps(original)
        def _prepare_for_training(self: Any, *args: Any, **kwargs: Any) -> Any:
            model, loader = original(self, *args, **kwargs)
            driver = driver_of(self)
            if driver is not None:
                driver.prepared(model)
            return model, loader

        return _prepare_for_training

    _wrap(cls, "__init__", make_init)
    _wrap(cls, "train", make_train)
    _wrap(cls, "get_train_dataloader", make_dataloader)
    _wrap(cls, "_init_training_state", make_init_state)
    _wrap(cls, "set_initial_training_values", make_initial_values)
    _wrap(cls, "_prepare_for_training", make_prepare)
    _wrap(cls, "_maybe_log_save_evaluate", make_log)
    _wrap(cls, "_save_checkpoint", make_save)
    _wrap(cls, "training_step", make_training_step)
    _wrap(cls, "compute_loss", make_compute_loss)
    _wrap(cls, "evaluate", make_loop)
    _wrap(cls, "predict", make_loop)
    # A subclass that evaluates its own way (transformers' QuestionAnsweringTrainer) builds its DataLoader before
    # its loop, and never calls the two above: the world is joined there too, before the DataLoader is sharded.
    _wrap(cls, "get_eval_dataloader", functools.partial(make_loop, loop="evaluate"))
    _wrap(cls, "get_test_dataloader", functools.partial(make_loop, loop="predict"))


def patch_trainer_utils(module: Any) -> None:
    def make(original: Any) -> Any:
        @functools.wraps(original)
        def get_last_checkpoint(folder: str) -> str | None:
            found = newest_committed(folder)
            theirs = original(folder)
            if theirs is not None and theirs != found:
                lifecycle(
                    "trainer_checkpoint_skipped",
                    level=logging.WARNING,
                    skipped=theirs,
                    instead=found,
                    why="not committed (a save cut short): get_last_checkpoint answers the newest committed one",
                )
            return found

        return get_last_checkpoint

    _wrap(module, "get_last_checkpoint", make)
