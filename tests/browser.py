"""A page opened in a real headless Chromium (Debian's ``chromium``), driven over the DevTools protocol.

Why: the report is read in a browser; what a browser does with it (console errors, requests it makes, charts
it lays out, how it looks) is only known by opening it in one. The protocol runs over a pipe
(``--remote-debugging-pipe``: file descriptors 3 and 4, JSON messages ended by NUL), so no port and no
client library are needed.

Contract: ``open_page(url, screenshot)`` loads ``url`` in a fresh headless Chromium with no network (every
request goes to a proxy that does not exist), saves a full-page PNG to ``screenshot``, and returns a
``PageVisit``: the console messages and log entries with their levels, every URL the page requested, and
``evaluate(expression)``'s JSON value computed in the loaded page. ``chromium()`` is the browser's path or None.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str | None:
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


@dataclass
class PageVisit:
    console: list[tuple[str, str]] = field(default_factory=list)  # (level, text): console calls and log entries
    requests: list[str] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)


class _Pipe:
    def __init__(self, to_browser: int, from_browser: int) -> None:
        self.out, self.inp, self.buffer, self.next_id = to_browser, from_browser, b"", 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.out, json.dumps(message).encode() + b"\0")
        return self.next_id

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self.buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from the browser")
            chunk = os.read(self.inp, 1 << 20)
            if not chunk:
                raise EOFError("the browser closed its pipe")
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float = 30.0) -> dict:
        wanted, deadline = self.send(method, params, session), time.monotonic() + timeout_s
        while True:
            message = self._read(deadline)
            if message.get("id") == wanted:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_event(self, method: str, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        for i, event in enumerate(self.events):
            if event.get("method") == method:
                return self.events.pop(i)
        while True:
            message = self._read(deadline)
            if message.get("method") == method:
                return message
            self.events.append(message)


def open_page(url: str, screenshot: Path, expressions: dict[str, str] | None = None,
              width: int = 1280, height: int = 900) -> PageVisit:
    """Load ``url`` offline, screenshot it, evaluate ``expressions`` (name -> JS returning JSON) in it."""
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("no chromium: install Debian's chromium package")
    to_read, to_browser = os.pipe()      # the browser reads its commands on fd 3
    from_browser, to_write = os.pipe()   # and writes its answers on fd 4
    profile = tempfile.mkdtemp(prefix="rollout-bus-chromium-")
    # through spare descriptors first: one of the pipe's own may be 3 or 4
    script = f"exec 200<&{to_read} 201>&{to_write}; exec 3<&200 4>&201 200<&- 201>&-; exec \"$@\""
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
            f"--user-data-dir={profile}", f"--window-size={width},{height}",
            "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "about:blank"]
    proc = subprocess.Popen(["bash", "-c", script, "chromium", *args], pass_fds=(to_read, to_write),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_read)
    os.close(to_write)
    pipe, visit = _Pipe(to_browser, from_browser), PageVisit()
    try:
        target = pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            pipe.call(f"{domain}.enable", session=session)
        pipe.call("Page.navigate", {"url": url}, session=session)
        pipe.wait_event("Page.loadEventFired")
        for name, expression in (expressions or {}).items():
            result = pipe.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                               session=session)
            visit.values[name] = result.get("result", {}).get("value")
        shot = pipe.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                         session=session)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        pipe.call("Browser.close")
    finally:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(to_browser)
        os.close(from_browser)
        shutil.rmtree(profile, ignore_errors=True)
    for event in pipe.events:
        params = event.get("params", {})
        if event.get("method") == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            visit.console.append((params.get("type", ""), text))
        elif event.get("method") == "Log.entryAdded":
            entry = params.get("entry", {})
            visit.console.append((entry.get("level", ""), f"{entry.get('text', '')} {entry.get('url', '')}".strip()))
        elif event.get("method") == "Runtime.exceptionThrown":
            visit.console.append(("error", json.dumps(params.get("exceptionDetails", {}))[:500]))
        elif event.get("method") == "Network.requestWillBeSent":
            visit.requests.append(params.get("request", {}).get("url", ""))
    return visit
