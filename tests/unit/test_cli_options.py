"""Argument handling of elastrain-run: torchrun's options unchanged, elastrain's defaults, one-line errors."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from elastrain.errors import UsageError
from elastrain.launcher import cli
from elastrain.launcher.options import (
    build_parser,
    options_from_args,
    parse_nnodes,
    parse_rdzv_conf,
    redact_conf,
    validate_and_default,
)

ETCD = ["--nnodes", "1:2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "h:2379"]
SCRIPT = str(Path(__file__))


@pytest.fixture(autouse=True)
def _environ_kept() -> Iterator[None]:
    """``cli.main`` prepares the workers' environment in this process's (the bootstrap on ``PYTHONPATH``) before it
    refuses some input: every process a later test of this worker starts would run the bootstrap."""
    kept = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(kept)


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate_and_default(args, argv, environ or {})
    return args


def test_every_torchrun_option_is_accepted_and_documented() -> None:
    torch_opts = {o for a in get_args_parser()._actions for o in a.option_strings}
    ours = build_parser()
    our_opts = {o for a in ours._actions for o in a.option_strings}
    assert torch_opts <= our_opts
    help_text = ours.format_help()
    for opt in torch_opts - {"-h", "--help"}:
        assert opt in help_text, opt


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", (1, 1)), ("2", (2, 2)), ("1:3", (1, 3)), ("2:2", (2, 2))],
)
def test_parse_nnodes(value: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(value) == expected


@pytest.mark.parametrize("value", ["0", "3:2", "a", "1:b", "1:2:3", "-1:2", "0:1"])
def test_parse_nnodes_rejects(value: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_nnodes(value)
    assert err.value.flag == "--nnodes"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", {}), ("a=1", {"a": "1"}), ("a=1, b = x=y", {"a": "1", "b": "x=y"})],
)
def test_parse_rdzv_conf(value: str, expected: dict[str, str]) -> None:
    assert parse_rdzv_conf(value) == expected


@pytest.mark.parametrize("value", ["a", "a=1,b", "=1", "a=", "a=1,,b=2"])
def test_parse_rdzv_conf_rejects(value: str) -> None:
    with pytest.raises(UsageError, match="--rdzv-conf"):
        parse_rdzv_conf(value)


def test_elastic_range_defaults_to_c10d() -> None:
    args = parse(["--nnodes", "1:3", SCRIPT])
    assert args.rdzv_backend == "c10d"


def test_explicit_backend_is_kept() -> None:
    args = parse(["--nnodes", "1:3", "--rdzv-backend", "torch-c10d", SCRIPT])
    assert args.rdzv_backend == "torch-c10d"


def test_pet_backend_counts_as_explicit() -> None:
    argv = ["--nnodes", "2", SCRIPT]
    args = build_parser().parse_args(argv)
    args.rdzv_backend = "static"
    validate_and_default(args, argv, {"PET_RDZV_BACKEND": "static"})
    assert args.rdzv_backend == "static"


def test_static_cannot_be_elastic() -> None:
    with pytest.raises(UsageError, match="--rdzv-backend"):
        parse(["--nnodes", "1:2", "--rdzv-backend", "static", SCRIPT])


def test_standalone_like_torchrun() -> None:
    args = parse(["--standalone", "--rdzv-endpoint", "ignored:1", SCRIPT])
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "localhost:0")
    assert args.rdzv_id != "none"


def test_single_node_default_like_torchrun() -> None:
    args = parse([SCRIPT])
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "localhost:0")
    assert args.master_port == 29500


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--nnodes", "3:2", SCRIPT], "--nnodes"),
        (["--nnodes", "0", SCRIPT], "--nnodes"),
        (["--rdzv-backend", "nope", SCRIPT], "--rdzv-backend"),
        (["--rdzv-conf", "timeout", SCRIPT], "--rdzv-conf"),
        (["/no/such/script.py"], "training_script"),
        (["--nproc-per-node", "0", SCRIPT], "--nproc-per-node"),
        (["--nproc-per-node", "lots", SCRIPT], "--nproc-per-node"),
        (["--max-restarts", "-1", SCRIPT], "--max-restarts"),
        (["--monitor-interval", "0", SCRIPT], "--monitor-interval"),
        (["--redirects", "9", SCRIPT], "--redirects"),
        (["--local-ranks-filter", "a,b", SCRIPT], "--local-ranks-filter"),
        (["--no-python", "-m", "mod"], "--no-python"),
        (["--no-python", "no-such-command-xyz"], "training_script"),
        (["--save-timeout", "-1", SCRIPT], "--save-timeout"),
        (["--collective-timeout", "0", SCRIPT], "--collective-timeout"),
        (["--first-step-timeout", "0", SCRIPT], "--first-step-timeout"),
        (["--io-timeout", "0", SCRIPT], "--io-timeout"),
        (["--nnodes", "2", "--rdzv-endpoint", "host:notaport", SCRIPT], "--rdzv-endpoint"),
        (["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:notaport", SCRIPT], "--rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-endpoint", "host:70000", SCRIPT], "--rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-backend", "torch-c10d", "--rdzv-endpoint", "h:x", SCRIPT], "--rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "h:x", SCRIPT], "--rdzv-endpoint"),
        (["--standalone", "--rdzv-conf", "read_timeout=abc", SCRIPT], "--rdzv-conf read_timeout"),
        (["--standalone", "--rdzv-conf", "read_timeout=inf", SCRIPT], "--rdzv-conf read_timeout"),
        ([*ETCD, "--rdzv-conf", "read_timeout=0", SCRIPT], "--rdzv-conf read_timeout"),
        (["--standalone", "--rdzv-conf", "heartbeat_interval=soon", SCRIPT], "--rdzv-conf heartbeat_interval"),
        (["--standalone", "--rdzv-conf", "secret=hunter2", SCRIPT], "--rdzv-conf secret"),
        (["--standalone", "--rdzv-conf", "secret_file=/no/such/file", SCRIPT], "--rdzv-conf secret_file"),
        (["--nnodes", "2", "--rdzv-conf", f"secret_file={SCRIPT}", SCRIPT], "--rdzv-conf secret_file"),  # static
        (["--standalone", "--rdzv-conf", "heartbeat_timout=10", SCRIPT], "--rdzv-conf heartbeat_timout"),  # a typo
        (["--standalone", "--nnodes", "2", SCRIPT], "--standalone"),
        (["--log-dir", SCRIPT, SCRIPT], "--log-dir"),
        (["--checkpoint-dir", "nope://bucket/ckpt", SCRIPT], "--checkpoint-dir nope://bucket/ckpt"),
        (["--standalone", "--rdzv-conf", "join_timeout_s=10", SCRIPT], "--rdzv-conf join_timeout_s"),
        (["--standalone", "--rdzv-conf", "store_op_timeout=0", SCRIPT], "--rdzv-conf store_op_timeout"),
        (["--standalone", "--rdzv-conf", "join_timeout=0", SCRIPT], "--rdzv-conf join_timeout"),
        (["--standalone", "--rdzv-conf", "last_call_timeout=-1", SCRIPT], "--rdzv-conf last_call_timeout"),
        (["--standalone", "--rdzv-conf", "heartbeat_interval=nan", SCRIPT], "--rdzv-conf heartbeat_interval"),
        (
            [
                "--nnodes",
                "2",
                "--rdzv-backend",
                "etcd-v3",
                "--rdzv-endpoint",
                "10.0.0.9:2379",
                "--rdzv-conf",
                "user=u,password=hunter2",
                SCRIPT,
            ],
            "--rdzv-conf password",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"elastrain-run: error: {flag}"), err


def test_an_unknown_rdzv_conf_key_is_reported_once_and_torch_keys_pass(capsys: pytest.CaptureFixture[str]) -> None:
    parse(["--standalone", "--rdzv-conf", "for_my_plugin=1,timeout=900,close_timeout=10,keep_alive_interval=5", SCRIPT])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["elastrain-run: warning: --rdzv-conf for_my_plugin: no rendezvous reads this key; ignored"], err
    parse(["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-conf", "heartbeat_timout=1", SCRIPT])  # torch's own
    assert capsys.readouterr().err == ""


def test_a_malformed_rdzv_conf_never_echoes_a_secret(capsys: pytest.CaptureFixture[str]) -> None:
    for conf in ("user=u,password=hunter2,oops", "password=hun,ter2,key_prefix", "token=hunter2,x", "a,secret=hunter2"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--nnodes", "2", "--rdzv-conf", conf, SCRIPT])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--rdzv-conf" in err and "hunter2" not in err and "ter2" not in err, err
    assert redact_conf("user=u,password=a,b,key_prefix=/x") == "user=u,password=<redacted>,<redacted>,key_prefix=/x"
    assert redact_conf("password_file=/run/pw,client_key=/k.pem") == "password_file=/run/pw,client_key=/k.pem"


def test_etcd_accepts_a_password_without_tls_on_loopback_or_when_told_to() -> None:
    for endpoint, conf in (
        ("127.0.0.1:2379", "user=u,password=p"),
        ("10.0.0.9:2379", "user=u,password=p,allow_insecure_password=true"),
    ):
        args = parse(["--nnodes", "2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-conf", conf,
                      SCRIPT])  # fmt: skip
        assert args.rdzv_backend == "etcd-v3"


def test_fencing_off_advice_fits_the_backend() -> None:
    from elastrain.launcher.launch import fencing_off_advice

    assert "--rdzv-backend etcd-v3" in fencing_off_advice("c10d")
    etcd = fencing_off_advice("etcd-v3")
    assert "--checkpoint-dir" in etcd and "use --rdzv-backend etcd-v3" not in etcd


def test_a_loopback_run_makes_the_workers_gloo_and_nccl_listen_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastrain.binding import loopback_interface
    from elastrain.launcher.launch import listen_on_loopback

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=eth9")  # the user's choice wins
    listen_on_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()
    assert os.environ["NCCL_SOCKET_IFNAME"] == "=eth9"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    listen_on_loopback("192.0.2.7")  # a node reached elsewhere: gloo and NCCL choose as before
    assert "GLOO_SOCKET_IFNAME" not in os.environ and "NCCL_SOCKET_IFNAME" not in os.environ


def test_elastrain_options_read_pet_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_CHECKPOINT_DIR", "/ckpt")
    monkeypatch.setenv("PET_SAVE_TIMEOUT", "5")
    monkeypatch.setenv("PET_IO_TIMEOUT", "900")
    opts = options_from_args(build_parser().parse_args([SCRIPT]))
    assert opts.checkpoint_dir == "/ckpt"
    assert opts.save_timeout_s == 5.0
    assert opts.io_timeout_s == 900.0
