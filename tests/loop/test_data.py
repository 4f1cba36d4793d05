"""Tasks and rewards: the arithmetic generator and its exact-match reward, the GSM8K format and its
reward, reward functions by import path (with clear errors), and the resumable prompt order."""
import json
import sys

import pytest

from zmrl.data import arithmetic, gsm8k
from zmrl.data.prompts import PromptStream, load_rows, prompts_of
from zmrl.data.rewards import RewardError, RewardFn


def test_arithmetic_rows_are_correct_and_seeded(tmp_path):
    rows = arithmetic.make_rows(200, seed=3, max_operand=9, ops="+-*")
    for r in rows:
        a, op, b = r["prompt"][0], r["prompt"][1], r["prompt"][2:-1]
        assert r["prompt"].endswith("=") and int(r["answer"]) == eval(f"{a}{op}{b}")
    assert rows == arithmetic.make_rows(200, seed=3, max_operand=9, ops="+-*")
    tiny = arithmetic.make_rows(50, first_operands=[1], max_operand=8, equals=False)
    assert {r["prompt"] for r in tiny} <= {f"1+{b}" for b in range(9)}
    path = arithmetic.write_dataset(tmp_path / "a.jsonl", size=10, max_answer=5)
    assert all(int(r["answer"]) <= 5 for r in load_rows(str(path)))


def test_arithmetic_shots_put_one_shared_solved_context_before_every_question():
    plain = arithmetic.make_rows(40, seed=2, first_operands=[1], max_operand=8, equals=False)
    shot = arithmetic.make_rows(40, seed=2, first_operands=[1], max_operand=8, equals=False, shots=8)
    context = shot[0]["prompt"][:-len(plain[0]["prompt"])]
    lines = context.splitlines()
    assert len(lines) == 8 and context.endswith("\n")
    for line in lines:  # each example written as it should be answered: question then answer
        b = int(line[2])
        assert line == f"1+{b}{b + 1}"
    for p, s in zip(plain, shot):  # the same questions and answers, each after the same context
        assert s == {"prompt": context + p["prompt"], "answer": p["answer"]}
    assert shot == arithmetic.make_rows(40, seed=2, first_operands=[1], max_operand=8, equals=False, shots=8)
    other = arithmetic.make_rows(40, seed=3, first_operands=[1], max_operand=8, equals=False, shots=8)
    assert other[0]["prompt"][:len(context)] != context, "the context is drawn from the seed"
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="shots must be an int >= 0"):
            arithmetic.make_rows(4, shots=bad)


def test_bad_operand_bounds_are_named():
    for name in ("max_operand", "max_answer"):
        for bad in (-1, 2.5, True):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 0, got {bad!r}"):
                arithmetic.make_rows(4, **{name: bad})
    with pytest.raises(ValueError, match="max_operand must be an int >= 0, got None"):
        arithmetic.make_rows(4, max_operand=None)
    assert arithmetic.make_rows(4, max_operand=0, max_answer=0) == [{"prompt": "0+0=", "answer": "0"}] * 4


def test_main_recipe_prompts_are_longer_than_index_topk_and_share_a_prefix(tmp_path):
    """The main job's prompts exercise sparse attention (longer than index_topk) and the prefix
    cache (at least one full 16-token block shared by every prompt)."""
    from tests.loop.conftest import RECIPE
    from zmrl.config import load_recipe
    from zmrl.model.presets import PRESETS
    from zmrl.model.tokenizer import train_tokenizer

    cfg = load_recipe(RECIPE, [])
    rows = arithmetic.make_rows(64, seed=cfg.run.seed, **cfg.data.generate_args)
    tok = train_tokenizer(PRESETS[cfg.model.init_preset]["vocab_size"], seed=cfg.model.init_seed)
    ids = [tok.encode(r["prompt"]) for r in rows]
    assert min(len(i) for i in ids) > PRESETS[cfg.model.init_preset]["index_topk"]
    shared = next(k for k in range(len(ids[0])) if len({tuple(i[:k + 1]) for i in ids}) > 1)
    assert shared >= 16, f"the prompts share only {shared} tokens: not one full cache block"
    assert cfg.rollout.max_num_batched_tokens < cfg.run.prompts_per_step * cfg.rollout.n * len(ids[0])


@pytest.mark.parametrize("completion, reward", [("7", 1.0), (" 7", 1.0), ("7.", 1.0), ("7 apples", 1.0),
                                                ("71", 0.0), ("-7", 0.0), ("x7", 0.0), ("", 0.0), ("8", 0.0)])
def test_arithmetic_reward_is_exact_on_the_leading_number(completion, reward):
    assert arithmetic.reward(completion, {"answer": "7"}) == reward


def test_arithmetic_format_credit_only_for_a_wrong_number():
    assert arithmetic.reward("8", {"answer": "7"}, format_reward=0.25) == 0.25
    assert arithmetic.reward("x8", {"answer": "7"}, format_reward=0.25) == 0.0
    assert arithmetic.reward("7", {"answer": "7"}, format_reward=0.25) == 1.0


def test_gsm8k_answers_and_prompts(tmp_path):
    row = {"question": "Tom has 3 apples and buys 1,200 more. How many?",
           "answer": "He has 3 + 1200 = <<3+1200=1203>>1203.\n#### 1,203"}
    assert gsm8k.reference_answer(row["answer"]) == "1203"
    assert gsm8k.reward("so the total is 1203", row) == 1.0
    assert gsm8k.reward("reasoning 5 ... #### 1,203.00", row) == 1.0
    assert gsm8k.reward("#### 1204", row) == 0.0 and gsm8k.reward("no number", row) == 0.0
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (prompt,) = prompts_of(load_rows(str(path)), "prompt", "gsm8k")
    assert prompt == "Question: Tom has 3 apples and buys 1,200 more. How many?\nAnswer:"
    with pytest.raises(ValueError, match="question"):
        prompts_of([{"prompt": "x"}], "prompt", "gsm8k")


def test_reward_functions_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def bad(c, e):\n    raise KeyError('answer')\n\ndef nan(c, e):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert RewardFn("zmrl.data.arithmetic:reward", {"format_reward": 0.5})("8", {"answer": "7"}) == 0.5
    with pytest.raises(RewardError, match="my_rewards:bad raised KeyError"):
        RewardFn("my_rewards:bad")("7", {"prompt": "3+4="})
    with pytest.raises(RewardError, match="returned nan"):
        RewardFn("my_rewards:nan")("7", {})
    for path, msg in [("my_rewards:missing", "no callable"), ("no_such_module_x:f", "cannot import"),
                      ("no_colon", "module:function")]:
        with pytest.raises(RewardError, match=msg):
            RewardFn(path)


def test_prompt_stream_resumes_from_its_cursor():
    a = PromptStream(7, seed=1)
    first = a.take(5)
    cursor = a.cursor
    rest = a.take(12)  # crosses two epoch boundaries
    b = PromptStream(7, seed=1, cursor=cursor)
    assert b.take(12) == rest
    assert sorted(first + rest[:2]) == list(range(7)), "each epoch visits every row once"
    assert PromptStream(7, seed=2).take(7) != PromptStream(7, seed=1).take(7)


def test_missing_or_unreadable_dataset(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(str(tmp_path / "none.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="could not be read"):
        load_rows(str(bad))


def test_json_files_read_without_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    lines = tmp_path / "rows.jsonl"
    lines.write_text('{"prompt": "1+1", "answer": "2"}\n\n{"prompt": "2+2"}\n')
    assert load_rows(str(lines)) == [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2", "answer": None}]
    array = tmp_path / "rows.json"
    array.write_text('[{"prompt": "3+3", "answer": "6"}]')
    assert load_rows(str(array)) == [{"prompt": "3+3", "answer": "6"}]
    not_object = tmp_path / "list.jsonl"
    not_object.write_text('{"prompt": "1"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"list.jsonl could not be read: line 2 is a list, not a JSON object"):
        load_rows(str(not_object))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl could not be read: line 2: "):
        load_rows(str(broken))
