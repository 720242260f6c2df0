"""Instructions the proxy spends on a relayed streamed token, counted by callgrind (deterministic).

    python benchmarks/relay_instructions.py [--shape sglang-incremental vllm] [--streams 2] [--tokens 200]
        [--interval 0.1] [--decode-steps] [--keep DIR] [--proxy-flag=--engine-health-interval=3600]
        [--top-logprobs K]

The engine (``actorproxy sim``, its own process, not traced) streams ``--tokens`` tokens a
reply, one every ``--interval`` seconds per stream (``--decode-steps``: every stream's at the
same instants, ``actorproxy sim --decode-steps``); the proxy (``actorproxy run``) runs under
``valgrind --tool=callgrind --instr-atstart=no``; ``long_streams.py``'s clients (their own
process) open ``--streams`` streaming chat turns through it. The count is switched on
(``callgrind_control -i on``) once every stream has its first token and off once the last
one ended, so what is counted is the relaying of tokens and the replies' ends (the last
chunk, with every token's logprobs when they are asked for: ``--top-logprobs``), not the
start-up or the prompts; the figure is the instructions of that window over the tokens the
clients received in it. Use a slow pace (the default) so the proxy keeps up under valgrind, and
the same arguments for the runs compared: the proxy is the checkout on ``PYTHONPATH``, so
old code is measured by running this script with ``PYTHONPATH`` at an old worktree.
``--keep DIR`` keeps each shape's callgrind output as ``DIR/callgrind.SHAPE.out``, to read
per function with ``callgrind_annotate --inclusive=yes``.

The window also counts what the proxy does on a clock, not per token: an engine health check
every ``--engine-health-interval`` seconds (5 by default: a whole HTTP exchange with the
engine) and the read deadlines' tick every second. At the default pace (a token every 100 ms
per stream) that is ~16,000 instructions a token at one stream, and it varies with how long
the window lasts under valgrind; ``--proxy-flag=--engine-health-interval=3600`` leaves the
health checks out, for comparing two trees on the relay's own cost.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from long_streams import SHAPES
from processes import free_port, running, sim_engine, wait_ready

HERE = Path(__file__).parent


def counted(out: Path) -> int:
    """The instructions a callgrind output file counts (its ``totals:`` line)."""
    text = out.read_text()
    found = re.search(r"^totals: (\d+)", text, re.M)
    if found is None:
        raise RuntimeError(f"no totals in {out}")
    return int(found.group(1))


def one_shape(args: argparse.Namespace, shape: str) -> None:
    backend, sim_flags, _ = SHAPES[shape]
    flags = ["--reply-tokens", str(args.tokens), "--token-interval", str(args.interval), "--record-capacity", "1",
             *sim_flags, *(["--decode-steps"] if args.decode_steps else [])]
    with sim_engine(*flags) as engine, tempfile.TemporaryDirectory(prefix="actorproxy-callgrind-") as tmp:
        out = Path(tmp) / "callgrind.out"
        port = free_port()
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                   sys.executable, "-m", "actorproxy", "run", "--port", str(port), "--backend", backend,
                   "--backend-url", engine.url, "--log-level", "WARNING", "--data-dir", str(Path(tmp) / "data"),
                   *args.proxy_flag]
        # Run from the temporary directory: ``python -m`` puts its working directory first on ``sys.path``,
        # so a run from inside a checkout would measure that checkout whatever ``PYTHONPATH`` says.
        with running(command, stderr=subprocess.DEVNULL, cwd=tmp) as proxy:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", proxy, timeout=600)
            clients = subprocess.Popen(
                [sys.executable, str(HERE / "long_streams.py"), "--clients", url, "--target", "chat",
                 "--streams", str(args.streams), "--tokens", str(args.tokens), "--interval", str(args.interval),
                 "--timeout", "600", "--top-logprobs", str(args.top_logprobs)], stdout=subprocess.PIPE, text=True)
            try:
                assert clients.stdout is not None
                line = clients.stdout.readline()
                if not line.startswith("STREAMING"):
                    raise RuntimeError(f"the clients did not get their streams going: {line!r}")
                subprocess.run(["callgrind_control", "-i", "on", str(proxy.pid)], check=True,
                               stdout=subprocess.DEVNULL)
                first = int(line.split()[1])
                line = clients.stdout.readline()
                subprocess.run(["callgrind_control", "-i", "off", str(proxy.pid)], check=True,
                               stdout=subprocess.DEVNULL)
                if not line.startswith("ENDING"):
                    raise RuntimeError(f"the clients ended badly: {line!r}")
                tokens = int(line.split()[1]) - first
                summary = clients.stdout.readline().strip()
                clients.wait(60)
            finally:
                if clients.poll() is None:
                    clients.kill()
                    clients.wait()
        instructions = counted(out)  # (written as the proxy exits)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out, args.keep / f"callgrind.{shape}.out")
    steps = (", decode steps" if args.decode_steps else "") + (
        f", {args.top_logprobs} alternatives a token" if args.top_logprobs else "")
    print(f"{shape:<18} {args.streams} streams x {args.tokens} tokens x {args.interval * 1000:g} ms{steps}: "
          f"{instructions:,} instructions over {tokens} tokens = {instructions / max(tokens, 1):,.0f} a token "
          f"({summary})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=["sglang-incremental", "vllm"], choices=sorted(SHAPES))
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds per token per stream")
    parser.add_argument("--decode-steps", action="store_true",
                        help="the engine decodes in steps: every stream's tokens at the same instants")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep each shape's callgrind output file in DIR")
    parser.add_argument("--proxy-flag", action="append", default=[],
                        help="an extra `actorproxy run` argument (e.g. --proxy-flag=--engine-health-interval=3600)")
    parser.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                        help="the turns ask for each token's K likeliest alternatives too (OpenAI's top_logprobs)")
    args = parser.parse_args()
    for shape in args.shape:
        one_shape(args, shape)


if __name__ == "__main__":
    main()
