from forge import console
from services.agentic import _preview


def test_the_first_failure_of_each_kind_is_printed_the_rest_counted(capsys, monkeypatch):
    """A run may fail thousands of episodes alike (e.g. each longer than max_model_len): the console
    shows the first of each kind, with its message, once; one of another kind shows too."""
    monkeypatch.setattr(console, "_seen", set())
    long = "ValueError: generate: prompt '{}' is {} tokens, longer than max_model_len 64"
    printed = [console.report("agent episode failed", long.format(p, n)) for p, n in (("abc", 70), ("xyz", 99))]
    printed.append(console.report("agent episode failed", "TimeoutError: no end within 30 s"))
    printed.append(console.report("env episode failed", long.format("abc", 70)))
    assert printed == [True, False, True, True]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"forge: agent episode failed: {long.format('abc', 70)} (the first like it; the rest are counted)"
    assert len(out) == 3


def test_long_prompts_of_one_failure_kind_print_once(capsys, monkeypatch):
    """An episode's failure names its task's prompt, cut to ~60 characters: still one quoted
    literal, so three prompts failing alike are one kind (a literal cut short is blanked too)."""
    monkeypatch.setattr(console, "_seen", set())
    error = "TimeoutError: no end within 30.0 s (config key 'agentic.episode_timeout_s')"
    prompts = [
        f"Question {w}: what is the sum of the numbers below? Answer after ####." for w in ("one", "two", "three")
    ]
    printed = [console.report("agent episode failed", f"{error} (task {_preview({'prompt': p})})") for p in prompts]
    assert printed == [True, False, False]
    assert console.report("x", "cut 'abc") and not console.report("x", "cut 'abcdef")
