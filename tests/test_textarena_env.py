"""TextArena's single-player games as GEM environments (lightning_nb/agents/textarena_env.py) on the real
``textarena`` package, and ``GEMRunner("textarena:GuessTheNumber-v0-raw")`` through the real runners, LLMProxy,
model and one GRPO step."""

from __future__ import annotations

import json
import sys
import time

import pytest

from lightning_nb import semconv
from lightning_nb import (AlgorithmConfig, GRPOConfig, GRPOTrainer, InMemoryStore, LightningRL, LLMProxy,
                          TripletAdapter, start_runners)
from lightning_nb.agents import TextArenaEnv
from lightning_nb.agents.agent_runner import EPISODE_METRICS, seed_tasks
from lightning_nb.agents.gem_runner import GEMRunner, check_reset, check_step, make_env
from lightning_nb.errors import ConfigError, MissingDependencyError

textarena = pytest.importorskip("textarena", reason="the envs extra: pip install 'lightning-nb[envs]'")

GAME = "GuessTheNumber-v0-raw"  # 1..20; needs no data and no network
LLM, STEP, FINAL = semconv.LLM_SPAN, semconv.INTERMEDIATE_REWARD_SPAN, semconv.REWARD_SPAN


def _wrong(secret):
    """A valid guess that is not ``secret``, and the hint GuessTheNumber answers it with."""
    return (secret + 1, "lower") if secret < 20 else (secret - 1, "higher")


def _close_reward(env_id, seed, replies, **make_kwargs):
    """Player 0's reward from TextArena's own ``close()`` after playing ``replies`` on a raw game (None while the
    game has not ended)."""
    game = textarena.make(env_id, **make_kwargs)
    game.reset(num_players=1, seed=seed)
    for reply in replies:
        done, _ = game.step(reply)
        if done:
            return float(game.close()[0][0])
    return None


# ----- no model -----
def test_reset_and_step_are_gem_shaped_without_the_echo_of_the_move():
    env = TextArenaEnv(GAME)
    obs, info = check_reset(env.reset(seed=3), env)
    assert obs.startswith("You are Player 0. You are playing Guess The Number.") and info == {"env_id": GAME}
    secret = env.game.game_number
    twin = TextArenaEnv(GAME)
    twin.reset(seed=3)
    assert twin.game.game_number == secret  # the seed draws the number
    guess, hint = _wrong(secret)
    out = check_step(env.step(f"My guess is [{guess}]"), env)
    # TextArena's raw observation is [(0, "My guess is [g]", PLAYER_ACTION), (-1, "The target number is ...", ...)]
    assert out == (f"The target number is {hint}.", 0.0, False, False, {})
    text, reward, terminated, _, _ = env.step("no number here")
    assert text.startswith("You attempted an invalid move.") and "no number here" not in text
    assert (reward, terminated) == (0.0, False)  # the first invalid move in a row only gets a note
    text, reward, terminated, truncated, info = check_step(env.step(f"[{secret}]"), env)
    assert (text, reward, terminated, truncated) == ("", 1.0, True, False)  # close(): {0: 1}
    assert info["reason"].startswith("Congratulations") and info["game_info"]["turn_count"] == 2
    with pytest.raises(ConfigError, match="after 'GuessTheNumber-v0-raw' ended"):
        env.step("[1]")
    with pytest.raises(ConfigError, match="before reset"):
        TextArenaEnv(GAME).step("[1]")
    with pytest.raises(ConfigError, match="reply text"):
        twin.step(3)


def test_a_wrapped_id_reads_the_same_messages_as_its_raw_id():
    raw, wrapped = TextArenaEnv(GAME), TextArenaEnv("GuessTheNumber-v0")  # LLMObservationWrapper + ActionFormatting
    assert raw.reset(seed=5)[0] == wrapped.reset(seed=5)[0]
    guess, hint = _wrong(raw.game.game_number)
    # TextArena's own LLMObservationWrapper would show the whole history with "[Player] [g]"; here only what is new
    assert raw.step(f"[{guess}]")[0] == wrapped.step(f"[{guess}]")[0] == f"The target number is {hint}."


def test_a_lost_game_gets_its_reward_from_close_only_at_the_end():
    # max_turns=1: GuessTheNumber 0.7.4 checks its turn limit before counting the guess, so the game ends at the
    # second valid guess with 1 - |last guess - target| / (20 - 1)
    env = TextArenaEnv(GAME, max_turns=1)
    env.reset(seed=7)
    secret = env.game.game_number
    first_guess, last_guess = [n for n in (1, 20, 10) if n != secret][:2]
    replies = [f"[{first_guess}]", f"[{last_guess}]"]
    first = env.step(replies[0])
    last = env.step(replies[1])
    assert first[1:3] == (0.0, False) and last[2] is True
    expected = 1 - abs(last_guess - secret) / 19
    assert last[1] == pytest.approx(expected) == _close_reward(GAME, 7, replies, max_turns=1)
    assert last[4]["reason"].startswith("The turn limit has been reached")
    # two invalid moves in a row end the game; with no valid guess yet TextArena's reward is 0.0
    env = TextArenaEnv(GAME)
    env.reset(seed=7)
    assert env.step("hmm")[1:3] == (0.0, False)
    text, reward, terminated, _, info = env.step("hmm again")
    assert (reward, terminated, info["game_info"]["invalid_move"]) == (0.0, True, True)
    assert _close_reward(GAME, 7, ["hmm", "hmm again"]) == 0.0


def test_unknown_ids_bad_kwargs_two_player_games_and_a_missing_package_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"'GuessTheNumbr-v0-raw' is not a TextArena id.*GuessTheNumber-v0-raw"):
        TextArenaEnv("GuessTheNumbr-v0-raw")
    with pytest.raises(ConfigError, match="'Nope-v0' is not a TextArena id"):
        make_env("textarena:Nope-v0")
    with pytest.raises(ConfigError, match="nor a TextArena id with its prefix"):
        make_env("GuessTheNumber-v0-raw")  # without the prefix it is looked up in GEM
    with pytest.raises(ConfigError, match=r"refused make_kwargs \['size'\]"):
        TextArenaEnv(GAME, size=3)
    with pytest.raises(ConfigError, match="single-player games; 'TicTacToe-v0-raw'.*has to be 2"):
        TextArenaEnv("TicTacToe-v0-raw").reset(seed=0)
    assert isinstance(make_env("textarena:" + GAME, {"max_turns": 2}), TextArenaEnv)
    monkeypatch.setitem(sys.modules, "textarena", None)  # `import textarena` raises ImportError
    with pytest.raises(MissingDependencyError, match=r"lightning-nb\[envs\]"):
        TextArenaEnv(GAME)


_REASON_WORDS = {"players": "player", "download": "download", "api_key": "API key", "python": "Python",
                 "package_files": "missing from the installed textarena package"}


def test_every_raw_game_of_the_registry_runs_or_is_refused_when_built_naming_why():
    """The sweep of TextArena's registry (no model): every ``-raw`` game is made and started (seed 0) by
    check_single_player; it either takes one scripted move, GEM-shaped and without the echo of that move, or is
    refused with a reason and a message that names it. ~40 s on 2 cores (Sudoku-v0-hard-raw's reset is ~20-30 s)."""
    from textarena.envs.registration import ENV_REGISTRY

    from lightning_nb.agents.textarena_env import check_single_player
    from lightning_nb.errors import ENV_REFUSAL_REASONS, EnvRefused

    runs, refused = [], {}
    move = "[1]"
    for game in sorted(g for g in ENV_REGISTRY if g.endswith("-raw")):
        try:
            env = check_single_player(game)
        except EnvRefused as exc:
            assert exc.reason in ENV_REFUSAL_REASONS and exc.reason != "error", (game, str(exc))
            assert _REASON_WORDS[exc.reason] in str(exc) and repr(game) in str(exc), (game, str(exc))
            refused[game] = exc.reason
            continue
        text, reward, terminated, truncated, _ = check_step(env.step(move), env)
        # the echo is (0, move, PLAYER_ACTION), (-1, move, PLAYER_ACTION) in TowerOfHanoi, or (PLAYER_ACTION, 0,
        # move) in Countdown, Cryptarithm and Slitherlink: none of it may reach the agent
        assert not {move, "0", "-1"} & set(text.split("\n")), (game, text)
        runs.append(game)
    assert len(runs) + len(refused) == len([g for g in ENV_REGISTRY if g.endswith("-raw")])
    # today's two-player games that start with one player anyway are refused by their player count
    assert refused["QuantumTicTacToe-v0-raw"] == refused["SpiteAndMalice-v0-raw"] == "players"
    # Wordle's module downloads an NLTK word list: refused offline, runs where the data is already there
    assert refused["TicTacToe-v0-raw"] == "players" and refused.get("Wordle-v0-raw", "runs") in ("download", "runs")
    assert refused["TwentyQuestions-v0-raw"] == "api_key"
    assert {"GuessTheNumber-v0-raw", "TowerOfHanoi-v0-raw", "Countdown-v0-raw", "Sudoku-v0-raw"} <= set(runs)
    print(f"\n{len(runs)} raw games run; refused: "
          f"{ {r: list(refused.values()).count(r) for r in sorted(set(refused.values()))} }")


def test_tower_of_hanoi_and_countdown_drop_the_echo_whatever_its_sender():
    for game in ("TowerOfHanoi-v0-raw", "Countdown-v0-raw"):
        raw = textarena.make(game)
        raw.reset(num_players=1, seed=0)
        raw.get_observation()
        raw.step("[1]")
        echo = [m for m in raw.get_observation()[1] if textarena.ObservationType.PLAYER_ACTION in (m[0], m[2])]
        assert len(echo) == 1 and echo[0][0] != 0  # sent from the game (-1), or with its arguments in another order
        env = TextArenaEnv(game)
        env.reset(seed=0)
        text = env.step("[1]")[0]
        assert text.startswith("You attempted an invalid move.") and "\n" not in text, text


# ----- the real model through runners + proxy, and one GRPO step -----
@pytest.mark.slow
def test_eight_guess_the_number_episodes_and_one_grpo_step(engine, pristine):
    """2 seeds x 4 episodes (one GRPO group per seed), max_steps 3, 12-token replies; max_turns=1 so that most
    episodes end inside 3 steps with TextArena's close() reward (see the lost-game test above). The four episodes of
    a seed run at once and re-seed the global ``random`` alike: their span IDs would collide without the fix
    (FACTS.md: 1-5 of 16 episodes lost). It was 4 seeds: the same check on twice the tokens."""
    t0 = time.perf_counter()
    store = InMemoryStore()
    proxy = LLMProxy(engine, store).start()
    store.add_resources({"main_llm": proxy.as_resource()})
    agent = GEMRunner("textarena:" + GAME, env_kwargs={"max_turns": 1}, max_steps=3)
    runners = start_runners(agent, store, n=8)  # 8 concurrent requests: the engine batches them (max_batch_size=8)
    # no reference copy: its KL forward would add a third of the update's time and tests nothing here
    trainer = GRPOTrainer(engine, GRPOConfig(learning_rate=1e-5, micro_batch_size=4, track_reference_kl=False))
    cfg = AlgorithmConfig(tasks_per_step=2, group_size=4, max_tokens=12, temperature=1.0, max_sample_rounds=1)
    algo = LightningRL(store, trainer, seed_tasks(2), [], cfg)
    try:
        row = algo.step()
    finally:
        algo.stop()
        runners.stop()
        proxy.stop()
    wall = time.perf_counter() - t0

    rollouts = store.query_rollouts()
    attempts = store.query_attempts()
    assert len(rollouts) == 8 and [r.status for r in rollouts] == ["succeeded"] * 8, store.attempts_df()["error"]
    assert len(attempts) == 8 and all(a.status == "succeeded" and not a.error for a in attempts)
    spans = store.query_spans()
    assert len({s.span_id for s in spans}) == len(spans)  # no span lost to an id another thread drew
    ended = 0
    for rollout in rollouts:
        mine = sorted((s for s in spans if s.rollout_id == rollout.rollout_id), key=lambda s: s.sequence_id)
        names = [s.name for s in mine if s.name in (LLM, STEP, FINAL)]
        calls = names.count(LLM)
        # every LLM call of the episode, each followed by its step reward, then the episode's reward
        assert 1 <= calls <= 3 and names == [LLM, STEP] * calls + [FINAL], (rollout.rollout_id, names)
        steps = [float(s.attributes[semconv.REWARD]) for s in mine if s.name == STEP]
        final = next(s.attributes for s in mine if s.name == FINAL)
        assert json.loads(final[EPISODE_METRICS])["llm_calls"] == calls
        assert steps[:-1] == [0.0] * (calls - 1) and float(final[semconv.REWARD]) == pytest.approx(steps[-1])
        # the same replies on TextArena's own game: its close() gives this reward, or the game had not ended
        replies = [str(s.attributes[semconv.COMPLETION]) for s in mine if s.name == LLM]
        expected = _close_reward(GAME, rollout.input["seed"], replies, max_turns=1)
        assert steps[-1] == pytest.approx(0.0 if expected is None else expected), (replies, steps)
        ended += expected is not None
    groups = {}
    for rollout in rollouts:
        groups.setdefault(rollout.metadata["group_id"], set()).add(rollout.input["seed"])
    assert len(groups) == 2 and all(len(seeds) == 1 for seeds in groups.values())

    triplets = TripletAdapter().adapt(store, [r.rollout_id for r in rollouts])
    assert len({t.rollout_id for t in triplets}) == 8
    assert row["step"] == 1 and row["rollouts"] == 8 and row["rollouts_failed"] == 0
    assert row["episodes"] == 8 and row["groups"] == 2 and len(trainer.last_batch) == 8  # one sequence each
    for seq in trainer.last_batch:  # the prompt and the observations between the replies are masked out
        assert len(seq["input_ids"]) == len(seq["response_mask"]) and 0 < sum(seq["response_mask"]) < len(
            seq["input_ids"])
    print(f"\n8 TextArena episodes + 1 GRPO step: {wall:.1f} s (rollouts {row['rollout_seconds']:.1f} s, "
          f"update {row['update_seconds']:.1f} s); {ended}/8 games ended; reward_mean {row['reward_mean']:.3f}; "
          f"groups_with_signal {row['groups_with_signal']}; spans {len(spans)}")
