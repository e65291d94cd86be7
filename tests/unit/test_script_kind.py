"""Which scripts may start warm (elastrain.launcher.script_kind): a table of sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrain.launcher.script_kind import ScriptKind, classify, classify_source

CASES = [
    ("from elastrain import Session\nwith Session(m, o, d, global_batch=8) as s: pass\n", ScriptKind.SESSION),
    ("from elastrain.session import Session as S\ns = S(m, o, d)\n", ScriptKind.SESSION),
    ("from transformers import Trainer, TrainingArguments\nt = Trainer(model=m)\nt.train()\n", ScriptKind.TRAINER),
    ("from transformers import Seq2SeqTrainer\ndef main():\n    Seq2SeqTrainer(model=m).train()\n", ScriptKind.TRAINER),
    ("import transformers\ntransformers.Trainer(model=m).train()\n", ScriptKind.TRAINER),
    ("import transformers as tf\ntr = tf.Trainer(model=m)\n", ScriptKind.TRAINER),
    ("from transformers import Trainer\nclass My(Trainer):\n    pass\nMy(model=m).train()\n", ScriptKind.TRAINER),
    ("from trl import SFTTrainer\nSFTTrainer(model=m).train()\n", ScriptKind.TRAINER),
    # Imported but never built: a custom loop that happens to import the name.
    ("from transformers import Trainer\nimport torch\nmodel.train()\n", ScriptKind.OTHER),
    ("import torch.distributed as dist\ndist.init_process_group('gloo')\n", ScriptKind.OTHER),
    ("from mylib import Trainer\nTrainer().fit()\n", ScriptKind.OTHER),
    ("def broken(:\n", ScriptKind.OTHER),
    ("", ScriptKind.OTHER),
]


@pytest.mark.parametrize(("source", "kind"), CASES)
def test_classify_source(source: str, kind: ScriptKind) -> None:
    assert classify_source(source) is kind


def test_classify_reads_the_script_a_worker_runs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(CASES[2][0])
    assert classify(["train.py", "--x"], str(tmp_path), []) is ScriptKind.TRAINER
    assert classify(["missing.py"], str(tmp_path), []) is ScriptKind.OTHER
    assert classify(["-c", "pass"], str(tmp_path), []) is ScriptKind.OTHER
