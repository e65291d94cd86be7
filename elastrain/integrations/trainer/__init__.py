"""Hugging Face ``Trainer`` scripts under elastrain-run, unmodified: elastic, exactly once, live.

:mod:`.hook` patches transformers as the worker imports it; :mod:`.driver` is elastrain's side of each
Trainer (resume, live regroup) and composes the rest: :mod:`.rescale` its batch plan; :mod:`.dataloader`
and :mod:`.stream` the data; :mod:`.boundaries` the step flags and where a regroup leaves ``train()``;
:mod:`.callback` its step boundaries and saves; :mod:`.checkpoints` the committed ``checkpoint-N``
folders; :mod:`.membership`, :mod:`.world` and :mod:`.memory` the live membership, the round and the state
that travels.
Importing this package imports nothing heavy: the parts import transformers and torch themselves.
"""
