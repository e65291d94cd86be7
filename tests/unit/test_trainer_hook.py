"""The Trainer integration's install (elastrain.integrations.trainer.hook): versions, refusal, idempotence."""

from __future__ import annotations

import types

import pytest

from elastrain.errors import EX_CONFIG
from elastrain.integrations.trainer import hook


@pytest.mark.parametrize(("version", "ok"), [("5.23.0", True), ("5.23.4", True), ("5.24.0", False), ("4.57.1", False)])
def test_only_tested_versions_are_patched(version: str, ok: bool) -> None:
    assert hook.supported(version) is ok


def test_an_untested_version_refuses_a_trainer_with_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class Trainer:
        def __init__(self) -> None:
            self.built = True

    module = types.ModuleType("fake_trainer")
    module.Trainer = Trainer  # type: ignore[attr-defined]
    hook._refuse(module)
    with pytest.raises(SystemExit) as exc:
        Trainer()
    assert exc.value.code == EX_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trainer-integration false" in err and "transformers" in err
