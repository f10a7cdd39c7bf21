import pytest

from forge.types import Completion, Episode, Score, collate


def completion(prompt, tokens, version=0):
    return Completion(
        prompt_ids=prompt,
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),
        text="x",
        finish_reason="stop",
        policy_version=version,
    )


def test_completion_checks_and_versions():
    c = completion([1, 2], [3, 4, 5], version=3)
    assert c.max_policy_version == 3
    with pytest.raises(ValueError, match="2 logprobs for 3 tokens"):
        Completion([1], [2, 3, 4], [-1.0, -1.0], "a", "stop")


def test_episode_from_completion():
    ep = Episode.from_completion(completion([1, 2], [3, 4, 5], version=4), score=Score(1.0, correct=1.0))
    assert ep.tokens == [1, 2, 3, 4, 5]
    assert ep.loss_mask == [0, 0, 1, 1, 1] and ep.num_response_tokens == 3
    assert ep.gen_logprobs == [0.0, 0.0, -0.5, -0.5, -0.5]
    assert ep.policy_version == 4 and ep.reward == 1.0
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 tokens"):
        Episode(tokens=[1, 2], loss_mask=[1], gen_logprobs=[0.0, 0.0])


def episodes():
    a = Episode.from_completion(completion([1, 2], [3, 4], version=1), advantage=0.5)
    b = Episode.from_completion(completion([5], [6, 7, 8], version=2), advantage=-1.0)
    c = Episode.from_completion(completion([9, 9, 9], [10], version=2), advantage=2.0)
    return [a, b, c]


def test_collate_padding():
    b = collate(episodes(), pad_id=0)
    assert b.input_ids.shape == (3, 4) and b.num_episodes == 3
    assert b.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 10]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]]
    assert b.advantages[0].tolist() == [0.5] * 4 and b.advantages[1, 1].item() == -1.0
    assert b.gen_logprobs[1].tolist() == [0.0, -0.5, -0.5, -0.5]
    assert b.ref_logprobs is None and b.policy_versions.tolist() == [1, 2, 2]

    padded = collate(episodes()[:1] + [Episode.from_completion(completion([1], [2]))], pad_id=0)
    assert padded.input_ids[1].tolist() == [1, 2, 0, 0] and padded.loss_mask[1].tolist() == [0, 1, 0, 0]
    assert padded.doc_ids[1].tolist() == [1, 1, -1, -1]


def test_collate_packs_episodes_into_rows():
    """Longest first, each into the first row it fits; positions restart at each episode and
    padding continues the last; doc ids stay the episodes' indices; empty rows pad the count."""
    eps = [Episode.from_completion(completion([7], [8], version=5), advantage=3.0)] + episodes()
    b = collate(eps, pad_id=0, pack_to=8, rows_multiple_of=3)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 10, 7, 8, 0, 0], [0] * 8]
    assert b.doc_ids.tolist() == [[1, 1, 1, 1, 2, 2, 2, 2], [3, 3, 3, 3, 0, 0, -1, -1], [-1] * 8]
    assert b.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1, 2, 3], list(range(8))]
    assert b.loss_mask[1].tolist() == [0, 0, 0, 1, 0, 1, 0, 0] and b.advantages[1, 4].item() == 3.0
    assert b.policy_versions.tolist() == [5, 1, 2, 2]
    alone = collate(eps, pad_id=0, pack_to=3)  # longer than pack_to: a row of its own
    assert alone.input_ids.shape == (4, 4) and alone.doc_ids[:, 0].tolist() == [1, 2, 3, 0]
    assert collate(eps, pad_id=0).positions is None  # unpacked: one episode per row from column 0
    rows = collate(eps, pad_id=0, rows_multiple_of=3)  # unpacked too: empty rows pad the count
    assert rows.input_ids.shape == (6, 4) and rows.doc_ids[4:].tolist() == [[-1] * 4] * 2
    assert rows.loss_mask[4:].sum() == 0 and rows.policy_versions.tolist() == [5, 1, 2, 2]


def test_collate_leaves_ref_logprobs_to_the_reference_and_moves():
    b = collate(episodes(), pad_id=0).to("meta")
    assert b.ref_logprobs is None and b.input_ids.device.type == "meta" and b.positions is None
    with pytest.raises(ValueError, match="no episodes"):
        collate([], pad_id=0)


def test_score_from_a_rollout_is_checked():
    assert Score.coerce({"reward": 1, "correct": True}, "x") == Score(1.0, correct=1.0)
    s = Score(0.5, {"a": 1.0})
    assert Score.coerce(s, "x") is s and not s.failed and Score(0.0, error="boom").failed
    with pytest.raises(TypeError, match=r"rollout: scores\[0\] has no field 'reward'"):
        Score.coerce({"correct": 1.0}, "rollout: scores[0]")
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['reward_failed'\]"):
        Score.coerce({"reward": 1.0, "reward_failed": 0.0}, "x")
    with pytest.raises(TypeError, match="is a float, not a forge.types.Score"):
        Score.coerce(1.0, "x")


def test_what_a_reward_function_or_agent_returns_is_loosely_a_score():
    """`loose`: a number, or a dict whose other keys are named components (reward: their sum
    unless given); the same TypeError for anything else."""
    assert Score.coerce(0.5, "x", loose=True) == Score(0.5) and Score.coerce(True, "x", loose=True) == Score(1.0)
    assert Score.coerce({"a": 1, "b": 0.5, "correct": 1}, "x", loose=True) == Score(1.5, {"a": 1.0, "b": 0.5}, 1.0)
    assert Score.coerce({"reward": 2, "a": 1}, "x", loose=True) == Score(2.0, {"a": 1.0})
    with pytest.raises(TypeError, match="returned 'done': is a str, not a number, a dict or a forge.types.Score"):
        Score.coerce("done", "returned 'done':", loose=True)
    with pytest.raises(TypeError, match="x: could not convert string to float: 'two'"):
        Score.coerce({"a": "two"}, "x", loose=True)
    with pytest.raises(TypeError, match="x: the reward is nan, not a finite number"):
        Score.coerce(float("nan"), "x", loose=True)
    with pytest.raises(TypeError, match="x: component 'a' is inf, not a finite number"):
        Score.coerce({"reward": 1.0, "a": float("inf")}, "x", loose=True)
    with pytest.raises(TypeError, match="rollout: scores.0.: the reward is -inf"):
        Score.coerce(Score(float("-inf")), "rollout: scores[0]")
