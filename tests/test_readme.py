"""Every command the README shows works as written from a fresh clone (issue
55: after `make demo`, the README's next command failed unless the venv
was active, which the README did not say).

The README's shell blocks run in order, as one bash script with ``set -e``
(stdin empty, so ``chat`` ends after loading), in a scratch directory that
holds the clone's ``.venv`` and ``tests`` (the two things a fresh clone's
commands use after ``make``); its Python blocks run after them, in the same
directory.  ``make demo`` and ``make test`` themselves are what the suite
and the demo check; the server's blocks run once the engine exists."""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _blocks() -> list:
    """``(language, text)`` of each fenced block, in order."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```(\w*)\n(.*?)```", text, re.S)


def _is_make(block: str) -> bool:
    return block.lstrip().startswith("make ")


def _is_server(block: str) -> bool:
    return "serve " in block or "127.0.0.1:8080" in block


@pytest.fixture
def clone(tmp_path):
    venv = os.path.join(ROOT, ".venv")
    if not os.path.isfile(os.path.join(venv, "bin", "activate")):
        pytest.skip("no .venv in the checkout (make creates it)")
    for name in (".venv", "tests"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    return tmp_path


def _bash(script: str, cwd, timeout=900) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh bash in its own process group; the group is
    killed when it ends or times out, so a command it left in the background
    (a server) can neither outlive the test nor hold its output open."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    # a fresh shell: the venv's python is not on PATH until the README activates it
    venv_bin = os.path.join(ROOT, ".venv", "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if os.path.realpath(p) != os.path.realpath(venv_bin))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(["bash", "-c", "set -eo pipefail\n" + script], cwd=cwd, env=env,
                             stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if rc is None:
        pytest.fail(f"the README's commands ran past {timeout} s\nstdout:\n{stdout[-3000:]}"
                    f"\nstderr:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(p.args, rc, stdout, stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_says_to_activate_the_venv_before_its_commands():
    shell = [b for lang, b in _blocks() if lang == "sh" and not _is_make(b)]
    assert shell and shell[0].strip() == ". .venv/bin/activate"


def test_readme_commands_run_as_written(clone):
    shell = [b for lang, b in _blocks() if lang == "sh" and not _is_make(b)
             and not _is_server(b)]
    python = [b for lang, b in _blocks() if lang == "python" and "OpenAI(" not in b]
    assert len(shell) >= 3 and len(python) >= 2
    script = "\n".join(shell)
    for i, code in enumerate(python):
        (clone / f"snippet{i}.py").write_text(code, encoding="utf-8")
        script += f"\npython snippet{i}.py"
    p = _bash(script, clone)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr
    # what the blocks show came out: a kernel's PTX, the model's description
    assert ".entry vector_add" in p.stdout and "ptxgen decode: yes" in p.stdout


def test_readme_server_commands_run_as_written(clone):
    pytest.importorskip("ptxgen.llm.engine", reason="the batched engine (ptxgen.llm.engine) "
                        "is not in this tree yet; serve needs it")
    blocks = _blocks()
    model_block = next(b for lang, b in blocks if lang == "sh" and "gguf.synth" in b)
    synth = next(ln for ln in model_block.splitlines() if "gguf.synth" in ln)
    serve = next(b for lang, b in blocks if lang == "sh" and "ptxgen serve" in b)
    curl = next(b for lang, b in blocks if lang == "sh" and "curl " in b)
    client = next(b for lang, b in blocks if lang == "python" and "OpenAI(" in b)
    # the README's port may be taken on this machine: the same commands on a free one
    port = str(_free_port())
    serve, curl, client = (b.replace("8080", port) for b in (serve, curl, client))
    (clone / "client.py").write_text(client, encoding="utf-8")
    wait = ("import os, sys, time, urllib.request\n"
            "for _ in range(1200):\n"
            "    os.kill(int(sys.argv[1]), 0)   # the server is still there\n"
            "    try:\n"
            f"        urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=5)\n"
            "        sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.5)\n"
            "sys.exit('the server did not answer /health')\n")
    (clone / "wait_health.py").write_text(wait, encoding="utf-8")
    script = (". .venv/bin/activate\n" + synth + "\n" + serve.strip() + "\nPID=$!\n"
              "trap 'kill $PID' EXIT\n"
              "python wait_health.py $PID\n"
              + (curl if shutil.which("curl") else "") + "\npython client.py\n")
    p = _bash(script, clone, timeout=1200)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    if shutil.which("curl"):
        assert '"object":"text_completion"' in p.stdout.replace(" ", "")
    assert "completion_tokens=" in p.stdout
