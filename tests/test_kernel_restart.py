"""A restarted kernel on a durable store whose resources name the dead proxy (issue 53, item 4), in a real kernel.

The first kernel is played by this process: it writes a SqliteStore whose ``main_llm`` is a port nobody listens on
and queues a rollout, then closes the file. A real IPython kernel (jupyter_client) then reopens the file, starts
runners with an agent that calls the LLM, and must hold that rollout (no attempt, still queued) until a live endpoint
is published: a small real OpenAI-compatible server (``conftest.FixedChatServer``) that answers "4".
"""

from __future__ import annotations

import time

from lightning_nb.store import SqliteStore
from lightning_nb.types import LLMResource, RolloutConfig

from conftest import FixedChatServer, closed_port, run_cell

CELL_OPEN = """
import warnings
import openai
from lightning_nb import start_runners
from lightning_nb.store import SqliteStore
from lightning_nb.types import LLMResource

store = SqliteStore({db!r})          # the kernel restarted: the store is reopened, its resources are the old ones
RID = {rid!r}

def agent(task, llm):                # a user's agent: calls the LLM, rewards a right answer
    client = openai.OpenAI(base_url=llm.endpoint, api_key="x", max_retries=0, timeout=30)
    reply = client.chat.completions.create(model=llm.model, messages=[{{"role": "user", "content": task}}])
    return float(reply.choices[0].message.content.strip() == "4")

with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    group = start_runners(agent, store, n=2)
print("\\n".join(str(w.message) for w in said))
"""


def _run_cell(kc, code: str, timeout: float = 60) -> str:
    return run_cell(kc, code, timeout)


def test_a_restarted_kernel_holds_the_queue_of_a_reopened_store_until_a_live_endpoint_is_published(tmp_path):
    from jupyter_client.manager import start_new_kernel

    db, dead = tmp_path / "run.db", f"http://127.0.0.1:{closed_port()}/v1"
    with SqliteStore(db) as before:  # the kernel before the restart: its proxy, one rollout queued
        before.add_resources({"main_llm": LLMResource(endpoint=dead, model="m")})
        rid = before.enqueue_rollout("What is 2 + 2?", config=RolloutConfig(max_attempts=1)).rollout_id
    server = FixedChatServer(lambda text: "4")
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        said = _run_cell(kc, CELL_OPEN.format(db=str(db), rid=rid), timeout=120)
        assert f"the LLM endpoint {dead} of 'main_llm'" in said and "the runners hold the whole queue" in said
        assert "store.add_resources({'main_llm': proxy.as_resource()})" in said
        time.sleep(3)  # runners poll every 0.2 s and probe about once a second: ample time to take it
        out = _run_cell(kc, "print(store.get_rollout_by_id(RID).status, len(store.query_attempts(RID)))")
        assert out.split() == ["queuing", "0"], out  # held: not sent to the dead port, not failed
        assert server.requests == []
        out = _run_cell(kc, f"store.add_resources({{'main_llm': LLMResource(endpoint={server.url!r}, model='fixed')}})\n"
                            "done = store.wait_for_rollouts([RID], timeout=30)\n"
                            "print([r.status for r in done], [a.status for a in store.query_attempts(RID)], "
                            "store.final_reward(RID))")
        assert out.split("\n")[-2] == "['succeeded'] ['succeeded'] 1.0", out
        assert len(server.requests) == 1
        _run_cell(kc, "group.stop(); store.close()")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        server.close()
