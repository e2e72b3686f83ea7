"""The widgets as a user sees them: JupyterLab 4 + headless Chromium run notebooks/02_widgets.ipynb.

Starts ``jupyter lab`` on 127.0.0.1 with a random token in a scratch folder holding
a copy of the notebook (so the committed one stays without outputs), opens it in
Debian's Chromium driven by Playwright (``executable_path``; no browser download),
runs all cells from the Run menu with ``LIGHTNING_NB_SMOKE=1``, waits for the reward
curve and the span table to show data from the real model, clicks a span row, Pause,
chats with the paused policy, Resume, and asserts on the DOM. Screenshots go to
``tests/_artifacts/browser/`` (git-ignored).

Chromium is installed with apt-get when missing; the test is skipped only when it
cannot be installed (no root or no apt-get, or the install fails).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "02_widgets.ipynb"
ARTIFACTS = ROOT / "tests" / "_artifacts" / "browser"

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def chromium_path() -> str:
    """Path of Debian's chromium, installing ``chromium`` and ``chromium-driver`` with apt-get if missing."""
    found = shutil.which("chromium")
    if found:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("chromium is missing and cannot be installed here (needs apt-get as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(f"could not install chromium: {' '.join(cmd)} exited {done.returncode}: {done.stderr[-500:]}")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get installed chromium but no `chromium` is on PATH")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on 127.0.0.1 serving a scratch copy of the notebook; yields (base_url, token)."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    shutil.copy(NOTEBOOK, work / NOTEBOOK.name)
    settings = home / "lab-settings" / "@jupyterlab"
    for plugin, text in (("apputils-extension/notification", '{"fetchNews": "false", "checkForUpdates": false}'),
                         ("notebook-extension/tracker", '{"autoStartDefaultKernel": true}')):
        (settings / f"{plugin}.jupyterlab-settings").parent.mkdir(parents=True, exist_ok=True)
        (settings / f"{plugin}.jupyterlab-settings").write_text(text)
    token, port = secrets.token_hex(16), _free_port()
    env = {**os.environ, "LIGHTNING_NB_SMOKE": "1", "TOKENIZERS_PARALLELISM": "false",
           "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / "lab-settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "ws")}
    log = (tmp_path / "jupyterlab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--ServerApp.port_retries=0",
         "--LabApp.extension_manager=readonly", *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/api/status", headers={"Authorization": f"token {token}"}, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not start: {(tmp_path / 'jupyterlab.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _count(page, selector: str) -> int:
    return page.locator(selector).count()


def _wait_for(page, what: str, predicate, timeout_s: float, shots: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            page.screenshot(path=str(shots / f"timeout-{what.replace(' ', '-')}.png"))
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; see {shots}")
        page.wait_for_timeout(500)


def test_dashboard_in_jupyterlab(jupyterlab):
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    base, token = jupyterlab
    shots = ARTIFACTS
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir(parents=True)
    print(f"\nscreenshots: {shots}")
    t0 = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True,
                                    args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1500, "height": 2000})
        try:
            _drive(page, base, token, shots, t0)
        except BaseException:
            page.screenshot(path=str(shots / "failure.png"))
            print("notebook outputs at failure:\n" + "\n---\n".join(
                page.locator(".jp-OutputArea-output").all_inner_texts())[-4000:])
            raise
        finally:
            browser.close()
    print(f"browser test took {time.monotonic() - t0:.0f} s")


def _drive(page, base: str, token: str, shots: Path, t0: float) -> None:
    """Open the notebook, run all cells, and check the dashboard as a user would."""
    page.goto(f"{base}/doc/tree/{NOTEBOOK.name}?token={token}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    kernel_idle = page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"ipykernel\)\s*\|\s*Idle"))
    _wait_for(page, "the kernel to be idle", lambda: kernel_idle.count() > 0, 90, shots)
    if page.locator(".jp-Dialog", has_text="Select Kernel").count():  # older settings: accept the preferred kernel
        page.locator(".jp-Dialog .jp-mod-accept").click()
    first_prompt = page.locator(".jp-CodeCell .jp-InputPrompt").first
    for _ in range(3):  # Run ▸ Run All Cells, as a user would (again if the kernel was not ready for it)
        page.keyboard.press("Escape")  # close a menu left open
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()
        deadline = time.monotonic() + 20
        while re.fullmatch(r"\[\s*\]:", first_prompt.inner_text().strip()) and time.monotonic() < deadline:
            page.wait_for_timeout(500)
        if not re.fullmatch(r"\[\s*\]:", first_prompt.inner_text().strip()):
            break
    else:
        raise AssertionError("Run All Cells did not start the notebook")

    dash = ".lnb-dashboard"
    page.wait_for_selector(dash, timeout=120_000)
    step_points = f"{dash} .lnb-reward-curve .subplot.xy .scatterlayer .trace .points path"
    batch_points = f"{dash} .lnb-reward-curve .subplot.x2y2 .scatterlayer .trace .points path"
    rows = f"{dash} .lnb-span-table tbody tr"
    _wait_for(page, "span table rows", lambda: _count(page, rows) > 0, 150, shots)
    _wait_for(page, "reward per batch", lambda: _count(page, batch_points) > 0, 150, shots)
    # one update done (the trainer panel shows loss, KL, reward) and the next step's rollouts on the curve
    step_cell = page.locator(f"{dash} .lnb-trainer-summary td[data-key='step']")
    _wait_for(page, "training step 1", lambda: step_cell.inner_text().strip() not in ("", "0"), 150, shots)
    _wait_for(page, "two points per training step", lambda: _count(page, step_points) >= 2, 120, shots)
    reward = float(page.locator(f"{dash} .lnb-trainer-summary td[data-key='reward (mean, last step)']").inner_text())
    assert 0.0 <= reward <= 1.0
    loss = page.locator(f"{dash} .lnb-trainer-summary td[data-key='loss']").inner_text()  # "–" if no advantage
    print(f"data after {time.monotonic() - t0:.0f} s: {_count(page, rows)} span rows, "
          f"{_count(page, step_points)} step points, {_count(page, batch_points)} batch points, loss {loss}")
    page.locator(dash).scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "01-dashboard-live.png"))

    # clicking the reward span of a finished rollout shows its tree: prompt, completion and token counts
    page.locator(rows).filter(has=page.locator("td", has_text=re.compile(r"^reward$"))).first.click()
    tree = f"{dash} .lnb-span-tree"
    page.wait_for_selector(f"{tree} .lnb-completion", timeout=30_000)
    assert "Solve the math problem" in page.locator(f"{tree} .lnb-prompt").first.inner_text()
    assert "completion tokens" in page.locator(f"{tree} .lnb-tokens").first.inner_text()
    assert _count(page, f"{tree} .lnb-span[data-name='reward']") >= 1
    assert page.locator(f"{rows}.lnb-selected").count() >= 1
    page.locator(tree).screenshot(path=str(shots / "02-span-tree.png"))

    # Pause: the trainer panel's state changes; chat answers while paused
    state = f"{dash} .lnb-trainer-summary .lnb-state"
    assert page.locator(state).get_attribute("data-state") == "running"
    page.locator(f"{dash} button.lnb-pause").click()
    page.wait_for_selector(f"{state}[data-state='paused']", timeout=30_000)
    assert page.locator(f"{dash} button.lnb-resume").is_enabled()
    page.locator(f"{dash} .lnb-chat-input input").fill("What is 7 + 5?")
    page.locator(f"{dash} button.lnb-chat-send").click()
    page.wait_for_selector(f"{dash} .lnb-chat-reply", timeout=90_000)
    reply = page.locator(f"{dash} .lnb-chat-reply").inner_text()
    assert reply.startswith("policy") and len(reply) > len("policy (weights v1, 0.0 s): ")
    page.locator(".lnb-trainer-panel").scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "03-paused-with-chat.png"))
    page.locator(".lnb-trainer-panel").screenshot(path=str(shots / "04-trainer-panel-paused.png"))
    page.locator(dash).screenshot(path=str(shots / "05-dashboard-paused.png"))

    page.locator(f"{dash} button.lnb-resume").click()
    page.wait_for_selector(f"{state}[data-state='running'], {state}[data-state='finished']", timeout=30_000)
    _rerun_start_runners(page, dash, shots)

    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                          has_text="Traceback")
    assert errors.count() == 0, errors.first.inner_text()
    assert _count(page, ".jp-OutputArea-output .lnb-store, .jp-RenderedHTMLCommon:has-text('InMemoryStore')") >= 1


def _run_cell(page, text: str, shots: Path, timeout_s: float = 90) -> Any:
    """Run the code cell whose source holds ``text`` (select it, Ctrl+Enter) and wait until it has run again.

    Returns its locator. "Ran again": its execution count changed and is no longer ``[*]``.
    """
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text=text)).first
    prompt = cell.locator(".jp-InputPrompt")
    before = prompt.inner_text().strip()
    prompt.click()  # command mode on this cell
    page.keyboard.press("Control+Enter")
    _wait_for(page, f"the cell {text!r} to run", lambda: re.fullmatch(r"\[\d+\]:", prompt.inner_text().strip())
              and prompt.inner_text().strip() != before, timeout_s, shots)
    return cell


def _rerun_start_runners(page, dash: str, shots: Path) -> None:
    """Re-run the start_runners cell (as after editing a reward): the runner panel shows the new group, all of
    it alive, and the kernel runs as many runner threads as before, not twice as many."""
    table = page.locator(f"{dash} .lnb-runner-panel table.lnb-runners")
    workers = lambda: set(re.findall(r"runner-\d+", table.inner_text()))  # noqa: E731
    old = workers()
    n = len(old)
    assert n > 0 and f"{n} of {n} runners alive" in page.locator(f"{dash} .lnb-runner-panel").inner_text()
    _run_cell(page, "runners = start_runners(", shots)
    _wait_for(page, "the runner panel to show the new group",
              lambda: workers() and not workers() & old and f"{n} of {n} runners alive" in
              page.locator(f"{dash} .lnb-runner-panel").inner_text(), 60, shots)
    assert page.locator(f"{dash} button.lnb-runners-start").is_disabled()  # nothing to restart: all alive
    output = _run_cell(page, "runner threads in this kernel", shots).locator(".jp-OutputArea-output")
    assert output.first.inner_text().strip() == f"runner threads in this kernel: {n}"
    page.locator(".lnb-runner-panel").screenshot(path=str(shots / "06-runner-panel-after-rerun.png"))
