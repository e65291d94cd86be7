"""Hugging Face ``Trainer`` scripts under elastrain-run, unmodified: elastic, exactly once, live.

:mod:`.hook` patches transformers as the worker imports it; :mod:`.driver` is elastrain's side of each
Trainer (batch plan, data stream, checkpoints, resume, live regroup); :mod:`.callback` its step
boundaries and saves; :mod:`.stream` the data; :mod:`.checkpoints` the committed ``checkpoint-N``
folders; :mod:`.membership` and :mod:`.memory` the live membership and the state that travels.
Importing this package imports nothing heavy: the parts import transformers and torch themselves.
"""
