"""A local HTTP server that answers in SGLang's shapes (tests/fixtures/sglang), for the engine client's tests.

``FixtureEngine()`` (a context manager) serves ``/generate`` and ``/v1/chat/completions`` on 127.0.0.1 with a
free port (``url``): a request without ``return_sampling_mask`` or whose sampling params truncate nothing gets
SGLang's 400; ``input_ids`` ``[666]`` makes it die mid-request (the connection is closed with no answer), and
so does each of the next ``count`` requests after ``die_next(count)``; anything else gets the fixture
(``generate_mask_only`` / ``chat_completion``), or what ``answer(path, doc, status)`` set (``answer_next(path,
*docs)``: those first, once each), after ``delay_s`` (0: at
once; an engine's latency, so a test lands a kill mid-episode). ``requests`` keeps every body.

``python -m tests.engine_server --port P [--delay-s S] [--stop]`` serves one as a process of its own, for the chaos
table's engine kills (``--stop``: every turn completes, ``finish_reason`` stop, so an environment goes on).
"""

from __future__ import annotations

import argparse
import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sglang"
DIE = [666]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *_):  # quiet
        pass

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        if self.server.delay_s[0] > 0:
            time.sleep(self.server.delay_s[0])
        if body.get("input_ids") == DIE or self.server.take_death():
            self.close_connection = True
            self.connection.shutdown(2)  # dies mid-request: no status line, no body
            return
        params = body.get("sampling_params", body)
        untruncated = (params.get("top_p", 1.0) >= 1.0 and params.get("top_k", -1) < 1
                       and params.get("min_p", 0.0) <= 0)
        if not body.get("return_sampling_mask") or untruncated:
            return self._answer(400, fixture("error_400_untruncated"))
        name = "chat_completion" if self.path == "/v1/chat/completions" else "generate_mask_only"
        queued = self.server.queued.get(self.path)
        doc, status = (queued.pop(0) if queued else None) or self.server.answers.get(self.path) or (fixture(name), 200)
        return self._answer(status, doc)

    def _answer(self, status: int, doc: dict) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


class FixtureEngine:
    def __init__(self, port: int = 0) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self.server.requests, self.server.answers, self.server.delay_s = [], {}, [0.0]
        self.server.queued = {}
        self.server.deaths, deaths_lock = [0], threading.Lock()

        def take_death() -> bool:
            with deaths_lock:
                if self.server.deaths[0] > 0:
                    self.server.deaths[0] -= 1
                    return True
                return False

        self.server.take_death = take_death
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def requests(self) -> list:
        return self.server.requests

    def answer(self, path: str, doc: dict, status: int = 200) -> None:
        """Answer ``path`` with ``doc`` (and ``status``) from now on."""
        self.server.answers[path] = (doc, status)

    def answer_next(self, path: str, *docs: dict) -> None:
        """Answer the next requests to ``path`` with ``docs``, in order, before the standing answer."""
        self.server.queued.setdefault(path, []).extend((doc, 200) for doc in docs)

    def delay(self, seconds: float) -> None:
        """Every answer from now on comes ``seconds`` after its request (0: at once)."""
        self.server.delay_s[0] = seconds

    def die_next(self, count: int = 1) -> None:
        """The next ``count`` requests die mid-request (the connection closed, no answer)."""
        self.server.deaths[0] = count

    def __enter__(self) -> "FixtureEngine":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.server.shutdown()
        self.server.server_close()


def stopping_answer() -> dict:
    """The fixture's ``/generate`` answer with ``finish_reason`` stop: a turn that completes."""
    answer = copy.deepcopy(fixture("generate_mask_only"))
    answer["meta_info"]["finish_reason"] = {"type": "stop"}
    return answer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.engine_server", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--stop", action="store_true", help="every turn completes (finish_reason stop)")
    args = parser.parse_args(argv)
    engine = FixtureEngine(args.port)
    if args.stop:
        engine.answer("/generate", stopping_answer())
    engine.delay(args.delay_s)
    print(f"fixture engine on {engine.url}", flush=True)
    engine.server.serve_forever()


if __name__ == "__main__":
    main()
