"""The command line an operator meets: fast help, a help text on every flag, and every mistake
(bad flags, bad config values, a busy port, a device this torch lacks) reported on one line
with exit status 2 before any model loads."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest
import torch

from expresslane.cli import build_parser, main

from .ports import free_port

HELP_WITHOUT_TORCH = (
    "import sys\n"
    "from expresslane.cli import main\n"
    "for argv in (['--help'], ['serve', '--help'], ['generate', '--help']):\n"
    "    try:\n"
    "        main(argv)\n"
    "    except SystemExit as e:\n"
    "        assert e.code == 0, e.code\n"
    "heavy = sorted(m for m in ('torch', 'numpy', 'httpx', 'fastapi') if m in sys.modules)\n"
    "print('loaded:', heavy)\n"
)


def test_help_loads_no_heavy_module():
    out = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT_TORCH], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("loaded: []"), out.stdout


def _subcommands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", s) for n, s in _subcommands(sub))


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_has_help(command):
    parser = dict(_subcommands(build_parser()))[command]
    missing = [a.dest for a in parser._actions if not a.help]
    assert missing == []


def test_vllm_flag_names():
    flags = dict(_subcommands(build_parser()))["serve"]._option_string_actions
    for flag in (
        "--served-model-name",
        "--api-key",
        "--max-model-len",
        "--max-num-seqs",
        "--kv-cache-dtype",
        "--quantization",
        "--dtype",
        "--seed",
        "--log-level",
        "--allowed-origins",
        "--host",
        "--port",
        "--no-enable-prefix-caching",
    ):
        assert flag in flags, flag


def _one_line_error(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("expresslane serve: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--port", "99999"], "99999 is not a port"),
        (["--port", "http"], "'http' is not a port number"),
        (["--model", "/no/such/dir"], "/no/such/dir does not exist"),
        (["--max-num-seqs", "0"], "must be at least 1"),
        (["--max-model-len", "lots"], "'lots' is not a whole number"),
        (["--kv-cache-memory-gb", "-1"], "must be a positive number"),
        (["--dtype", "float8"], "invalid choice: 'float8'"),
        (["--log-format", "xml"], "invalid choice: 'xml'"),
        (["--lane", "ultrafast"], "expected LANE.SETTING=VALUE"),
        (["--lane", "turbo.max_batch=2"], "unknown lane 'turbo'"),
        (["--speculative", "{method="], "is not a TOML table"),
        (["--config", "/no/such.toml"], "/no/such.toml is not a file"),
        (["--device", "quantum"], "argument --device: 'quantum' is not a device"),
        (["--allowed-origins", "[1]"], "a JSON list of strings"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags(capsys, flags, says):
    assert says in _one_line_error(capsys, ["serve", *flags])


def test_model_directory_without_config_json(capsys, tmp_path):
    line = _one_line_error(capsys, ["serve", "--model", str(tmp_path)])
    assert "not a Hugging Face model directory" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has a CUDA device")
def test_cuda_on_a_cpu_build(capsys):
    assert "has no CUDA device" in _one_line_error(capsys, ["serve", "--device", "cuda"])


@pytest.mark.parametrize(
    "toml, says",
    [
        ('[server]\nport = "8000"\n', "[server] port = '8000': expected int"),
        ("[server]\nport = 70000\n", "[server] port = 70000: use 1 to 65535"),
        ("[server]\nmax_body_bytes = 1.5\n", "[server] max_body_bytes = 1.5: expected int"),
        ('[server]\nlog_level = "loud"\n', "[server] log_level = 'loud'"),
        ("[server]\nallowed_origins = 3\n", "[server] allowed_origins = 3: expected list"),
        ("[server]\nportt = 1\n", "unknown [server] setting(s) ['portt']"),
        ('[engine]\nmax_batch = "64"\n', "[engine] max_batch = '64': expected int"),
        ("[engine]\nkv_cache_memory_gb = true\n", "expected float"),
        ('[engine]\nmodel = "/no/such/dir"\n', "[engine] model: /no/such/dir does not exist"),
        ('[engine]\ndevice = "cuda:99"\n', "[engine] device: cuda:99"),
        ("[lanes.flex]\nmax_batch = 0\n", "max_batch must be at least 1"),
        ("server]\n", "is not valid TOML"),
    ],
)
def test_bad_config_values(capsys, tmp_path, toml, says):
    config = tmp_path / "expresslane.toml"
    config.write_text(toml)
    assert says in _one_line_error(capsys, ["serve", "--config", str(config)])


def test_flags_win_over_the_config_file_even_at_their_defaults(tmp_path, monkeypatch):
    import expresslane.cli.serving as serve_module

    loaded = []
    monkeypatch.setattr(serve_module, "_load", loaded.append)  # returns None: serve stops
    config = tmp_path / "expresslane.toml"
    config.write_text(
        '[engine]\nmax_batch = 8\nkv_cache_dtype = "fp8"\nmax_num_batched_tokens = 256\n'
    )
    port = str(free_port())
    flags = ["--max-batch", "64", "--kv-cache-dtype", "auto", "--port", port]
    main(["serve", "--config", str(config), *flags])
    (engine,) = loaded
    assert (engine.max_batch, engine.kv_cache_dtype) == (64, "auto")  # the flags, as given
    assert engine.max_num_batched_tokens == 256  # the file, where no flag was given
    assert engine.enable_prefix_caching and engine.device == "auto"  # EngineConfig's defaults


def test_busy_port_is_found_before_the_model_loads(capsys, monkeypatch):
    import expresslane.cli.serving as serve_module

    monkeypatch.setattr(serve_module, "_load", lambda config: pytest.fail("model loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _one_line_error(capsys, ["serve", "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line


def test_busy_port_from_a_real_process(tmp_path):
    """The installed entry point, as an operator runs it: one line on stderr, status 2."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "expresslane.cli", "serve", "--port", str(port)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"expresslane serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
