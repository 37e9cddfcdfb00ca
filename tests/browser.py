"""A page opened in real headless Chromium (Debian's `chromium`, make setup),
driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON
messages, each ended by a NUL, on file descriptors 3 and 4), so that the
standard library is all a test needs: every console message and exception,
every network request the page makes, what a script finds in its DOM, and a
screenshot."""

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class Browser:
    def __init__(self):
        self.profile = tempfile.mkdtemp(prefix="kvtrace-chromium-")
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()
        # the child's fd 3 reads our commands, its fd 4 writes the answers
        def fds():
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--remote-debugging-pipe", "--no-sandbox",
             "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={self.profile}", "about:blank"],
            # close_fds keeps pass_fds, and closes the rest after preexec_fn:
            # 3 and 4 are named so that the dup2()s survive it
            preexec_fn=fds, pass_fds=(3, 4),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self.buf = b""
        self.next_id = 0
        self.events = []  # (the tab's id, method, params) of every event seen

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.from_child], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self.from_child, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed its pipe")
            self.buf += chunk
        msg, _, self.buf = self.buf.partition(b"\0")
        return json.loads(msg)

    def call(self, method: str, params: dict = None, tab: str = None,
             timeout: float = 60) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if tab:
            msg["sessionId"] = tab
        os.write(self.to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._read(deadline)
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            if "method" in m:
                self.events.append((m.get("sessionId"), m["method"], m.get("params", {})))

    def wait_event(self, method: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while not any(e[1] == method for e in self.events):
            m = self._read(deadline)
            if "method" in m:
                self.events.append((m.get("sessionId"), m["method"], m.get("params", {})))

    def close(self):
        try:
            self.call("Browser.close", timeout=10)
        except (OSError, RuntimeError, TimeoutError, EOFError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.to_child)
        os.close(self.from_child)
        shutil.rmtree(self.profile, ignore_errors=True)


FIGURES_JS = """JSON.stringify([...document.querySelectorAll('figure')].map(f => {
  const svg = f.querySelector('svg'), r = (svg || f).getBoundingClientRect();
  return {id: f.id, missing: f.dataset.missing, svg: !!svg, width: r.width,
          height: r.height, shapes: svg ? svg.querySelectorAll('path, rect, image, text, use').length : 0,
          text: f.innerText.length, title: (f.querySelector('h2') || {}).textContent};
}))"""


def open_page(path, screenshot) -> dict:
    """Open the file `path` in headless Chromium; write a full-page PNG
    screenshot to `screenshot`.  Returns {"figures": what FIGURES_JS finds,
    "console": console messages and exceptions, "errors": log entries of
    level error, "requests": every URL the page asked for but its own}."""
    b = Browser()
    try:
        target = b.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        tab = b.call("Target.attachToTarget", {"targetId": target,
                                                    "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            b.call(f"{domain}.enable", tab=tab)
        url = "file://" + os.path.abspath(path)
        b.call("Page.navigate", {"url": url}, tab=tab)
        b.wait_event("Page.loadEventFired")
        figures = json.loads(b.call("Runtime.evaluate", {"expression": FIGURES_JS,
                                                          "returnByValue": True},
                                    tab=tab)["result"]["value"])
        shot = b.call("Page.captureScreenshot", {"format": "png",
                                                 "captureBeyondViewport": True},
                      tab=tab)
        with open(screenshot, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
        ev = b.events
        return {
            "figures": figures,
            "console": [p for _, m, p in ev if m in ("Runtime.consoleAPICalled",
                                                      "Runtime.exceptionThrown")],
            "errors": [p["entry"] for _, m, p in ev if m == "Log.entryAdded"
                       and p["entry"].get("level") == "error"],
            "requests": [p["request"]["url"] for _, m, p in ev
                         if m == "Network.requestWillBeSent" and p["request"]["url"] != url],
        }
    finally:
        b.close()
