"""Agentic rollouts: environments (in the environment pool) and unmodified agents drive
multi-turn episodes through the gateway (the fixture `served`); what the gateway
recorded becomes the episodes; a failing or hanging environment or agent costs its episode."""

import asyncio
import itertools
import json
import math
import time
from types import SimpleNamespace

import pytest

# openenv.core imports gradio, which ast.parses its own source on import. Imported here, at
# collection, before services start threads in this process: CPython 3.11.7's ast raises a
# spurious "recursion depth mismatch" SystemError in threaded processes (CPython gh-106905).
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

from forge.config import import_object
from forge.metrics import MetricWriter
from forge.rollout import RolloutError
from forge.tasks import Sample, get_task
from forge.types import Episode
from services.agentic import AgenticRollouts, AgentPool, run_agent
from services.envs import EnvPool
from services.envs.guess import GuessWord, guess_agent
from services.schema import AgenticConfig

TASK = Sample("rev abc=", "cba", "reverse")


@pytest.fixture(scope="module")
def pools(loop):
    names = ("TwoStepEnv", "RaisingEnv", "HangingEnv", "FlakyEnv")
    pools = {n: loop.run_until_complete(EnvPool.options().as_service(f"agentic_actors:{n}", 8)) for n in names}
    yield pools
    for p in pools.values():
        loop.run_until_complete(p.shutdown())


@pytest.fixture(scope="module")
def allowed(tiny_model_dir):
    """Letters and <|im_end|>: text that re-tokenizes to the ids sampled, so turns extend."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tok, [tok.convert_tokens_to_ids(c) for c in "abcdefghij"] + [tok.convert_tokens_to_ids("<|im_end|>")]


@pytest.fixture(scope="module")
def agents(loop, served):
    """The agent pool on the gateway of `served`."""
    gw, *_ = served
    pool = loop.run_until_complete(AgentPool.options().as_service(gw.base_url))
    yield pool
    loop.run_until_complete(pool.shutdown())


def rollouts(served, pool, group_size=4, **cfg):
    """Rollouts through the gateway of `served`, on `pool`: the agent pool for an agent, an
    environment pool for an environment."""
    gw, *_ = served
    return AgenticRollouts(AgenticConfig(**cfg), gw, pool, group_size, std_normalize=True)


def metrics(loop, tmp_path) -> dict:
    writer = MetricWriter(tmp_path, ["jsonl"])
    try:
        return loop.run_until_complete(writer.flush(1))
    finally:
        writer.close()


def assert_group_relative(rewards, advantages) -> None:
    """GRPO's advantages: each reward minus the group's mean, all scaled by one positive factor
    (1 / std, or 1); all zero when the rewards are all equal."""
    centered = [r - sum(rewards) / len(rewards) for r in rewards]
    scales = [a / c for a, c in zip(advantages, centered) if abs(c) > 1e-6]
    if not scales:
        assert all(a == 0 for a in advantages), (rewards, advantages)
        return
    assert scales[0] > 0, (rewards, advantages)
    assert all(a == pytest.approx(c * scales[0], abs=1e-5) for a, c in zip(advantages, centered)), (rewards, advantages)


def test_env_episodes_train_only_the_policys_tokens(loop, served, pools, allowed, tmp_path):
    """Two policy turns around a tool reply, one sequence per episode: loss mask 1 exactly on
    the tokens the generator sampled (their logprobs), 0 on the prompt and the environment's
    reply; advantages relative to the group; the turn counts in the metrics."""
    tok, ids = allowed
    sampling = {"max_tokens": 5, "temperature": 1.0, "extra_body": {"allowed_token_ids": ids}}
    r = rollouts(served, pools["TwoStepEnv"], env="agentic_actors:TwoStepEnv", max_turns=4, sampling=sampling)
    metrics(loop, tmp_path)  # start from a clean slate
    episodes = loop.run_until_complete(r.group(TASK))
    row = metrics(loop, tmp_path)
    assert len(episodes) == 4  # one sample each: the second prompt extends the first turn token for token
    for e in episodes:
        trained = [t for t, m in zip(e.tokens, e.loss_mask) if m]
        assert set(trained) <= set(ids) and 2 <= len(trained) <= 10  # two turns of at most 5 sampled tokens
        assert all((lp < 0) == bool(m) for lp, m in zip(e.gen_logprobs, e.loss_mask))  # logprobs only where sampled
        masked = tok.decode([t for t, m in zip(e.tokens, e.loss_mask) if not m])
        assert "rev abc=" in masked and "<tool_response>42</tool_response>" in masked  # prompt and tool: not trained
        assert e.score.correct == 1.0 and e.reward in (0.0, 1.0) and e.task == "reverse"
    assert_group_relative([e.reward for e in episodes], [e.advantage for e in episodes])
    assert row["episode/turns"] == 2 and row["episode/samples"] == 1 and row["env/step_s"] < 1
    assert row["tokens/trained"] == sum(sum(e.loss_mask) for e in episodes)


def test_max_episode_tokens_ends_an_episode(loop, served, pools, tmp_path):
    metrics(loop, tmp_path)
    r = rollouts(
        served, pools["TwoStepEnv"], env="agentic_actors:TwoStepEnv", max_episode_tokens=1, sampling={"max_tokens": 3}
    )
    episodes = loop.run_until_complete(r.group(TASK))
    row = metrics(loop, tmp_path)
    assert len(episodes) == 4 and row["episode/turns"] == 1 and row["episode/truncated"] == 4


def test_an_unmodified_agent_trains(loop, served, agents):
    r = rollouts(served, agents, agent="agentic_actors:two_call_agent")
    episodes = loop.run_until_complete(r.group(TASK))
    assert len(episodes) >= 4 and all(e.score.correct == 0.0 and e.reward in (0.0, 1.0) for e in episodes)
    assert all(sum(e.loss_mask) >= 1 for e in episodes)


def test_failures_cost_only_their_episode(loop, served, pools, agents, tmp_path):
    """A raising environment, a hanging one (step timeout) and a raising agent each end their
    episodes, counted with their message, within bounded time; a group keeps its other
    episodes (on_failure: mask) or is dropped (drop); the pool closes every environment."""
    metrics(loop, tmp_path)
    start = time.monotonic()
    raising = rollouts(served, pools["RaisingEnv"], env="agentic_actors:RaisingEnv")
    hanging = rollouts(served, pools["HangingEnv"], env="agentic_actors:HangingEnv", step_timeout_s=1.0)
    agent = rollouts(served, agents, agent="agentic_actors:raising_agent")

    async def all_three():
        return await asyncio.gather(raising.group(TASK), hanging.group(TASK), agent.group(TASK))

    results = loop.run_until_complete(all_three())
    assert results == [[], [], []] and time.monotonic() - start < 30
    row = metrics(loop, tmp_path)
    assert row["env_errors"] == 8 and row["agent_errors"] == 4 and row["groups_dropped"] == 3
    for name in ("RaisingEnv", "HangingEnv"):
        assert loop.run_until_complete(pools[name].open_episodes.route()) == 0

    flaky = dict(env="agentic_actors:FlakyEnv", sampling={"max_tokens": 3})  # every other episode raises
    kept = loop.run_until_complete(rollouts(served, pools["FlakyEnv"], **flaky).group(TASK))
    dropped = loop.run_until_complete(rollouts(served, pools["FlakyEnv"], on_failure="drop", **flaky).group(TASK))
    per_episode = {id(e.score): (e.reward, e.advantage) for e in kept}  # an episode may be several samples
    assert len(per_episode) == 2 and dropped == []
    assert_group_relative(*zip(*per_episode.values()))


def test_an_agent_returning_no_reward_stops_the_run(loop, served, agents):
    with pytest.raises(RolloutError, match="agent 'agentic_actors:wrong_return_agent' returned 'done'"):
        loop.run_until_complete(rollouts(served, agents, agent="agentic_actors:wrong_return_agent").group(TASK))


def test_what_an_agent_raises_is_its_episodes_error_by_name(loop, served, agents):
    """An agent lets the gateway's 400 through (openai.BadRequestError: a class pickle cannot
    rebuild): the episode fails naming that error and the gateway's message, not a TypeError of
    the unpickling."""
    result = loop.run_until_complete(rollouts(served, agents, agent="agentic_actors:over_limit_agent").episode({}))
    assert result.score is None and result.error.startswith("BadRequestError: Error code: 400"), result.error
    assert "max_tokens" in result.error


def test_an_agent_the_pool_cannot_import_stops_the_run_naming_it(loop, served, agents):
    """The pool's process cannot import the agent (another host, another working directory):
    no episode could run, so the run stops naming it instead of failing every episode."""
    r = rollouts(served, agents, agent="no_such_module:run")
    with pytest.raises(
        RolloutError, match="the agent pool: config key 'agentic.agent': cannot import 'no_such_module:run'"
    ):
        loop.run_until_complete(r.group(TASK))


def test_an_agent_blocking_its_event_loop_blocks_neither_the_run_nor_its_gateway(loop, served, tmp_path):
    """An agent that blocks its event loop 4 s (`time.sleep`, a blocking library) runs in the
    agent pool: the controller's loop (the gateway, the other episodes, the trainer's calls) goes
    on, and the episode is abandoned at its timeout; in the controller, nothing could have timed
    it out and the whole run would have stood still."""
    gw, *_ = served
    pool = loop.run_until_complete(AgentPool.options().as_service(gw.base_url))
    r = rollouts(served, pool, agent="agentic_actors:blocking_agent", episode_timeout_s=1.5)
    metrics(loop, tmp_path)

    async def main():
        gaps, last = [], time.monotonic()

        async def tick():
            nonlocal last
            while True:
                await asyncio.sleep(0.05)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.ensure_future(tick())
        start = time.monotonic()
        try:
            await r.group(TASK)
        finally:
            ticker.cancel()
        return time.monotonic() - start, max(gaps)

    try:
        took, longest_stall = loop.run_until_complete(main())
    finally:
        loop.run_until_complete(pool.shutdown())
    assert longest_stall < 1.0 and took < 3.5, (took, longest_stall)
    assert metrics(loop, tmp_path)["agent_errors"] >= 1


def test_an_agent_pool_replica_an_agent_blocks_for_good_is_replaced(loop, served, tmp_path, caplog):
    """An agent that never gives its event loop back wedges its agent pool replica: once the
    abandoned episode's cancellation goes unanswered for step_timeout_s, the replica is replaced,
    and the next group runs on the new one (on the wedged one, every episode would time out). The
    console says so once, with why (not a second line calling it dead)."""
    gw, *_ = served
    pool = loop.run_until_complete(AgentPool.options().as_service(gw.base_url))
    r = rollouts(served, pool, agent="agentic_actors:spinning_agent", episode_timeout_s=1.0, step_timeout_s=1.0)
    try:
        with caplog.at_level("WARNING", logger="forge"):
            loop.run_until_complete(r.group(TASK))
            loop.run_until_complete(asyncio.sleep(1.5))  # the abandon's wait
        said = [m.getMessage() for m in caplog.records if "AgentPool replica" in m.getMessage()]
        assert len(said) == 1 and "did not answer within 1.0 s" in said[0] and "respawning" in said[0], said
        r.cfg.agent = "agentic_actors:sure_agent"
        call = r.pool.pinned().run.route(r.cfg.agent, "e", "s", {})
        assert loop.run_until_complete(asyncio.wait_for(call, 30)).reward == 1.0
    finally:
        loop.run_until_complete(pool.shutdown())


def test_an_agent_that_ends_its_process_costs_only_its_episode(loop, served, tmp_path):
    """An agent that ends its process (os._exit, a native library's abort) takes its agent pool
    replica with it, not the run: its episode fails, counted (never run again: its first run
    already spoke to the gateway), the group trains on the others, and the respawned replica
    runs the next group."""
    gw, *_ = served
    pool = loop.run_until_complete(AgentPool.options().as_service(gw.base_url))
    r = rollouts(served, pool, agent="agentic_actors:dying_agent")
    metrics(loop, tmp_path)
    try:
        first = loop.run_until_complete(r.group(TASK))
        row = metrics(loop, tmp_path)
        assert len({id(e.score) for e in first}) == 3 and row["agent_errors"] == 1
        assert len(loop.run_until_complete(r.group(TASK))) == 3  # the respawned replica's process: again one dies
    finally:
        loop.run_until_complete(pool.shutdown())


def test_an_openenv_environment_runs_through_the_adapter(loop, served):
    """An environment written against OpenEnv's interfaces, served by openenv-core's own server
    on 127.0.0.1 and reached through its websocket client, runs episodes via OpenEnvAdapter."""
    import socket

    import uvicorn

    from forge.env import OpenEnvAdapter, run_env_episode

    class Say(Action):
        text: str

    class Heard(Observation):
        text: str = ""

    class Echo(Environment):
        """Two turns: the reward is 1 when the second message is as long as the first."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state, self.said = State(episode_id="e", step_count=0), []

        def reset(self, seed=None, episode_id=None, **kwargs) -> Heard:
            self.said = []
            return Heard(text=f"say something about {kwargs.get('topic', 'nothing')}")

        def step(self, action: Say, timeout_s=None, **kwargs) -> Heard:
            self.said.append(action.text)
            self._state.step_count += 1
            done = len(self.said) == 2
            reward = float(done and len(self.said[0]) == len(self.said[1]))
            return Heard(text="again", done=done, reward=reward)

        @property
        def state(self) -> State:
            return self._state

    class EchoClient(EnvClient):
        def _step_payload(self, action):
            return {"text": action.text}

        def _parse_result(self, payload):
            obs = Heard(**payload.get("observation", {}), done=payload.get("done", False), reward=payload.get("reward"))
            return StepResult(observation=obs, reward=payload.get("reward"), done=payload.get("done", False))

        def _parse_state(self, payload):
            return State(**payload)

    gw, *_ = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        import openai

        app = create_fastapi_app(Echo, Say, Heard, max_concurrent_envs=4)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        try:
            results = []
            for _ in range(3):
                env = OpenEnvAdapter(
                    EchoClient(base_url=f"http://127.0.0.1:{port}"),
                    to_action=lambda message: Say(text=message.get("content") or ""),
                    to_messages=lambda obs: [{"role": "user", "content": obs.text}],
                    reset_kwargs=lambda task: {"topic": task["task"]},
                )
                sid = gw.open_session()
                client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=sid, max_retries=0)
                step, stats = await run_env_episode(env, client, TASK.row(), gw.model_name, 4, 10.0, {"max_tokens": 3})
                results.append((step, stats, await gw.finish(sid)))
            return results
        finally:
            server.should_exit = True
            await serving

    results = loop.run_until_complete(main())
    for step, stats, record in results:
        assert step.done and step.reward in (0.0, 1.0) and stats.turns == 2 and not stats.truncated
        assert len(record.turns) == 2


def test_the_calculator_environment():
    """The `calc` task's tool as a MessageEnv: a call gets the sum in a tool message, the next
    reply is scored; a malformed call ends the episode at 0."""
    from services.envs.calculator import Calculator

    env = Calculator()
    messages, tools = env.reset({"prompt": "345+678=", "answer": "1023", "task": "calc"})
    assert messages == [{"role": "user", "content": "345+678="}] and tools is None
    step = env.step({"role": "assistant", "content": "calc 345+678"})
    assert not step.done and step.messages[0]["role"] == "tool" and step.messages[0]["content"] == "1023"
    assert env.step({"role": "assistant", "content": "1023"}).reward == 1.0
    env.reset({"prompt": "345+678=", "answer": "1023", "task": "calc"})
    assert env.step({"role": "assistant", "content": "calc 345+687"}).messages[0]["content"] == "1032"
    assert env.step({"role": "assistant", "content": "1032"}).reward == 0.0  # the sum of a wrong call: wrong
    env.reset({"prompt": "345+678=", "answer": "1023", "task": "calc"})
    bad = env.step({"role": "assistant", "content": "1023"})  # no call
    assert bad.done and bad.reward == 0.0 and bad.info["malformed_call"] == 1.0


class _GuessingClient:
    """An OpenAI client stand-in whose model plays `guess`: the best play (reading each answer),
    or always `aaa`. It records the histories it was sent."""

    def __init__(self, best: bool):
        self.game, self.best, self.sent = get_task("guess"), best, []
        self.models = SimpleNamespace(list=self._models)
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _models(self):
        return SimpleNamespace(data=[SimpleNamespace(id="tiny")])

    async def _create(self, model, messages, **kw):
        self.sent.append([dict(m) for m in messages])
        guess = "aaa"
        if self.best and len(messages) > 1:
            guess = self.game.next_guess(messages[-2]["content"].strip(), messages[-1]["content"])
        content = guess + "\n"  # as a model might: the next history must carry it as sampled
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=content))])


def test_the_guess_environment_and_agent(loop):
    """`guess` as a MessageEnv: each wrong guess gets its letters in place as a user message, the
    right word ends the episode at the best play's turns / the turns taken, and the sixth wrong
    guess at 0. The agent plays the same game with an openai-style client and sends its replies
    back as sampled (so the gateway's turns extend token for token)."""
    task = {"prompt": "guess ???=", "answer": "dab", "task": "guess"}
    env = GuessWord()
    messages, tools = env.reset(task)
    assert messages == [{"role": "user", "content": "guess ???="}] and tools is None
    first = env.step({"role": "assistant", "content": "aaa"})
    assert not first.done and first.messages == [{"role": "user", "content": ".a."}]
    for guess in ("bab", "cab"):
        assert env.step({"role": "assistant", "content": guess}).messages[0]["content"] == ".ab"
    solved = env.step({"role": "assistant", "content": " dab\n"})
    assert solved.done and solved.reward == 1.0 and solved.info == {"correct": 1.0, "turns": 4.0}
    env.reset(task)
    steps = [env.step({"role": "assistant", "content": "ccc"}) for _ in range(6)]
    assert [s.done for s in steps] == [False] * 5 + [True] and steps[-1].reward == 0.0
    assert steps[-1].info["correct"] == 0.0

    best, blind = _GuessingClient(best=True), _GuessingClient(best=False)
    assert loop.run_until_complete(guess_agent(best, task)) == {"reward": 1.0, "correct": 1.0, "turns": 4.0}
    assert best.sent[-1][1:5] == [
        {"role": "assistant", "content": "aaa\n"},
        {"role": "user", "content": ".a."},
        {"role": "assistant", "content": "bab\n"},
        {"role": "user", "content": ".ab"},
    ]
    assert loop.run_until_complete(guess_agent(blind, task)) == {"reward": 0.0, "correct": 0.0, "turns": 6.0}
    assert len(blind.sent) == 6


@pytest.mark.parametrize(
    "expression",
    [
        "((9**64)**64)**64",  # each power under the old exponent check, the result ~10**(61*64*64) digits
        "2**64**64",
        "(10**300 * 10**300) * (10**300 * 10**300)",  # products past the bound
        "10**308 * 1e10",  # a float past its range: inf
        "(" * 5000 + "1" + ")" * 5000,  # past the length bound (and the parser's recursion)
    ],
)
def test_the_calculator_bounds_every_intermediate_result(expression):
    """Whatever a policy writes, an expression is refused within milliseconds with a ValueError (the
    tool message) instead of taking the environment replica's CPU and memory."""
    from services.envs.calculator import MathWithCalculator, evaluate

    start = time.monotonic()
    with pytest.raises(ValueError):
        evaluate(expression)
    assert time.monotonic() - start < 0.5
    env = MathWithCalculator()
    env.reset({"prompt": "?", "answer": "#### 4"})
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c",
                "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
            }
        ],
    }
    step = env.step(call)
    assert not step.done and "error" in step.messages[0]["content"].lower()
    assert evaluate("(48 + 24) * 3 / 2") == 108 and evaluate("2**1000") == 2**1000 and evaluate("-3**2") == -9


class _FakeGateway:
    """The gateway, in-process: each session's client answers 'hi', its record one sample."""

    model_name = "tiny"

    def __init__(self):
        self.sessions = itertools.count()

    def open_session(self):
        return str(next(self.sessions))

    def client(self, session):
        async def create(**kw):
            message = SimpleNamespace(model_dump=lambda **k: {"role": "assistant", "content": "hi"})
            return SimpleNamespace(choices=[SimpleNamespace(message=message)], usage=None)

        async def close():
            pass

        return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)), close=close)

    async def finish(self, session):
        return SimpleNamespace(turns=[1], samples=lambda: [Episode([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.1])])


class _FakePool:
    """The environment pool's endpoints, in-process, on environments `env` ("module:name") makes."""

    def __init__(self, env):
        make, envs = import_object("agentic.env", env), {}

        async def reset(episode, task):
            envs[episode] = make()
            return envs[episode].reset(task)

        async def step(episode, message):
            return envs[episode].step(message)

        async def close(episode):
            envs.pop(episode).close()

        route = [SimpleNamespace(route=fn) for fn in (reset, step, close)]
        self.session = SimpleNamespace(reset=route[0], step=route[1], close=route[2])

    def pinned(self):
        return self.session


class _FakeAgents:
    """The agent pool's endpoints, in-process, with the fake gateway's clients."""

    def __init__(self):
        async def run(agent, episode, session, task):
            return await run_agent(agent, _FakeGateway().client(session), task)

        async def abandon(episode):  # the caller's cancellation reached the agent itself
            pass

        replica = SimpleNamespace(respawns=0, healthy=True)
        self.session = SimpleNamespace(
            run=SimpleNamespace(route=run), abandon=SimpleNamespace(route=abandon), replica=replica
        )

    def pinned(self):
        return self.session


def offline(pool=None, **cfg):
    pool = pool or (_FakeAgents() if cfg.get("agent") else None)
    return AgenticRollouts(AgenticConfig(**cfg), _FakeGateway(), pool, 4, std_normalize=True)


def test_a_non_finite_reward_costs_only_its_episode(loop, tmp_path):
    """An environment's NaN reward, an agent's inf: that episode fails, counted, and its group
    trains on the others with finite advantages (not the whole group's NaNs, or a stopped run)."""
    metrics(loop, tmp_path)
    env = loop.run_until_complete(offline(_FakePool("agentic_actors:NanEnv"), env="agentic_actors:NanEnv").group(TASK))
    agent = loop.run_until_complete(offline(agent="agentic_actors:inf_agent").group(TASK))
    row = metrics(loop, tmp_path)
    assert row["env_errors"] == 1 and row["agent_errors"] == 1
    for episodes in (env, agent):
        assert len(episodes) == 3 and all(math.isfinite(e.advantage) and e.reward == 1.0 for e in episodes)


def test_a_lone_episode_trains_when_the_advantages_are_not_the_groups():
    """A critic's or teachers' advantages (algorithm ppo, distill: not `relative`) need no
    siblings: a group of one trains, and so does a group of four with one episode left; GRPO's,
    relative to the group, need two episodes that succeeded."""

    def group(group_size, relative, agent):
        cfg = AgenticConfig(agent=f"agentic_actors:{agent}")
        r = AgenticRollouts(cfg, _FakeGateway(), _FakeAgents(), group_size, std_normalize=True, relative=relative)
        return asyncio.run(r.group(TASK))

    [episode] = group(1, False, "sure_agent")
    assert episode.reward == 1.0 and episode.advantage == 0.0  # the critic's or teachers' come at train time
    assert group(1, True, "sure_agent") == []
    assert len(group(4, False, "lone_agent")) == 1 and group(4, True, "lone_agent") == []


@pytest.mark.parametrize("agent", ["stubborn_agent", "exiting_agent"])
def test_an_agent_that_ignores_its_timeout_or_exits_costs_its_episode(agent):
    """An agent swallowing its cancellation is abandoned at episode_timeout_s (asyncio.wait_for
    would wait for it), one raising SystemExit fails: that episode only, never trained on."""

    async def main():
        start = time.monotonic()
        episodes = await offline(agent=f"agentic_actors:{agent}", episode_timeout_s=0.2).group(TASK)
        return episodes, time.monotonic() - start

    episodes, took = asyncio.run(main())
    assert len(episodes) == 3 and took < 1.0  # the stubborn episode runs on 1.5 s


def test_a_session_the_gateway_closed_for_idling_costs_only_its_episode(loop, served, agents, tmp_path):
    """An agent idle past gateway.session_timeout_s (a long tool call) finds its session closed
    and its turns dropped by the gateway: that episode fails, counted with a message naming the
    key, and its group trains on the others instead of the whole group raising."""
    gw, *_ = served
    r = rollouts(served, agents, agent="agentic_actors:idling_agent")
    metrics(loop, tmp_path)
    saved = gw.cfg.session_timeout_s

    async def main():
        gw.cfg.session_timeout_s = 0.2
        gw._reaper.cancel()
        gw._reaper = asyncio.ensure_future(gw._reap())
        try:
            return await r.group(TASK)
        finally:
            gw.cfg.session_timeout_s = saved

    episodes = loop.run_until_complete(main())
    row = metrics(loop, tmp_path)
    assert len({id(e.score) for e in episodes}) == 3 and row["agent_errors"] == 1


def test_an_episode_given_up_while_waiting_for_a_place_leaves_none_taken(loop):
    """The caller gives up on a reset still waiting for a place (its step timeout, the episode's
    timeout) and closes the episode: the pool's place is not taken later by an environment no one
    will close (a full pool would then time out every episode)."""
    pool = loop.run_until_complete(EnvPool.options().as_service("agentic_actors:TwoStepEnv", 1))
    task = TASK.row()

    async def main():
        env = pool.pinned()
        await env.reset.route("held", task)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(env.reset.route("waiting", task), 0.5)
        await env.close.route("waiting")  # as run_env_episode's `finally` does
        await env.close.route("held")
        await asyncio.wait_for(env.reset.route("next", task), 10)  # the place is free again
        await env.close.route("next")
        return await env.open_episodes.route()

    try:
        assert loop.run_until_complete(main()) == 0
    finally:
        loop.run_until_complete(pool.shutdown())


def test_an_environment_whose_info_is_not_numbers_stops_the_run_naming_it(loop):
    """EnvStep.info holds numbers (a Score's components and `correct`): text there stops the run
    at its first episode, naming the environment (not later, at the trainer's metrics, naming nothing)."""
    r = offline(_FakePool("agentic_actors:NotedEnv"), env="agentic_actors:NotedEnv")
    with pytest.raises(RolloutError, match="env 'agentic_actors:NotedEnv'.*'note'"):
        loop.run_until_complete(r.group(TASK))


def test_an_episode_the_gateway_has_no_session_for_costs_only_that_episode(loop, served, agents, tmp_path):
    """More episodes at once than gateway.max_sessions: the one refused a session fails alone,
    counted, with the gateway's message, and its group trains on the others."""
    gw, *_ = served
    r = rollouts(served, agents, agent="agentic_actors:one_call_agent")
    metrics(loop, tmp_path)
    saved = gw.cfg.max_sessions

    async def main():
        gw.cfg.max_sessions = len(gw.sessions) + 3
        try:
            return await r.group(TASK)
        finally:
            gw.cfg.max_sessions = saved

    episodes = loop.run_until_complete(main())
    row = metrics(loop, tmp_path)
    assert len({id(e.score) for e in episodes}) == 3 and row["agent_errors"] == 1
