"""Predicted outputs (speculative/prediction.py): the drafter follows a prediction, finds it again after an edit, and
a task with a prediction writes plain greedy's text in fewer steps, whatever the prediction says."""

from __future__ import annotations

from specserve.engine.local_runner import LocalRunner
from specserve.engine.tasks import Result
from specserve.gguf.tokenizer import Tokenizer
from specserve.speculative.base import SpecParams
from specserve.speculative.prediction import PredictionDrafter
from tests.helpers import running_scheduler, submit, wait

FILE = list(range(100, 160))  # a "file" of 60 distinct tokens


def run(drafter: PredictionDrafter, answer: list[int], prompt: list[int], n_max: int = 8) -> tuple[int, int]:
    """Greedy verification of the drafter's drafts against a known answer: (steps, drafted tokens accepted)."""
    history, steps, accepted = list(prompt), 0, 0
    last, rest = answer[0], answer[1:]
    while rest:
        draft = drafter.draft(history, last, n_max)
        n = 0
        while n < len(draft) and n < len(rest) and draft[n] == rest[n]:
            n += 1
        drafter.accept(n)
        steps += 1
        accepted += n
        if n == len(rest):  # the answer ends inside the draft
            break
        history += [last, *rest[:n]]
        last, rest = rest[n], rest[n + 1:]
    return steps, accepted


def test_an_unchanged_answer_is_drafted_whole() -> None:
    steps, accepted = run(PredictionDrafter(FILE), FILE, [1, 2, 3])
    # every draft accepted whole: 8 drafted + 1 sampled a step
    assert steps == -(-(len(FILE) - 1) // 9) and accepted == len(FILE) - 1 - (steps - 1)


def test_the_drafter_finds_the_prediction_again_after_an_edit() -> None:
    inserted = FILE[:20] + [7, 8, 9] + FILE[20:]  # three new tokens
    deleted = FILE[:20] + FILE[30:]  # ten tokens gone
    replaced = FILE[:20] + [7, 8] + FILE[25:]  # five tokens become two
    for answer in (inserted, deleted, replaced):
        steps, accepted = run(PredictionDrafter(FILE), answer, [1, 2, 3])
        # an edit costs a step per new token and one or two more, not the rest of the file
        assert steps <= -(-(len(answer) - 1) // 9) + 5, (steps, accepted)


def test_a_prediction_with_nothing_in_common_drafts_nothing() -> None:
    drafter = PredictionDrafter([5, 6, 7])
    assert drafter.draft([1, 2, 3], 50, 8) == [] and drafter.stats.gen_tokens == 0


def test_a_task_with_a_prediction_writes_greedy_text_in_fewer_steps(smollm_runner: LocalRunner,
                                                                     smollm_tokenizer: Tokenizer) -> None:
    prompt = "Fruits: apples, pears, plums, cherries, grapes, figs.\nFruits: apples, pears,"
    plain = SpecParams(n_max=0)
    with running_scheduler(smollm_runner, smollm_tokenizer) as sched:
        text, alone = wait(submit(sched, smollm_tokenizer, prompt, n_predict=40, spec=plain, ignore_eos=True)[1])
        assert isinstance(alone, Result) and alone.n_predicted == 40
        exact = smollm_tokenizer.encode(text, add_special=False)
        # a word changed in the middle: the prediction is an edit away from the answer
        edited = smollm_tokenizer.encode(text.replace("plums", "peaches", 1) if "plums" in text else "x" + text,
                                         add_special=False)
        for prediction in (exact, edited, smollm_tokenizer.encode("nothing alike at all", add_special=False)):
            got, result = wait(submit(sched, smollm_tokenizer, prompt, n_predict=40, spec=SpecParams(n_max=16),
                                      prediction=prediction, ignore_eos=True)[1])
            assert isinstance(result, Result) and got == text
            generated, accepted = result.draft_sources.get("prediction", (0, 0))
            assert accepted <= generated and result.draft_n_accepted >= accepted
            if prediction is exact:
                assert accepted >= 30 and result.n_steps <= 8, (result.draft_sources, result.n_steps)
            if prediction is edited:
                assert accepted >= 20, result.draft_sources


# ---- through the server -----------------------------------------------------------------------------------------


def test_predicted_outputs_through_the_openai_client() -> None:
    """`prediction` on chat completions, as OpenAI's client sends it: the same text as without, in fewer steps, and
    usage says how many prediction tokens the answer took; /v1/completions and /completion take it too."""

    from tests import app_engine

    http = app_engine.client()
    client = app_engine.openai_client(http)
    messages = [{"role": "user", "content": "Write the numbers from one to twelve in words, comma separated."}]
    plain = app_engine.greedy_chat(client, messages, 40, extra_body={"speculative.n_max": 0})
    text = plain.choices[0].message.content
    assert text and plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    edited = text.replace("five", "5", 1) if "five" in text else "Sure: " + text
    # all but the first token and the end can come from the prediction: most do (the answer's length follows the
    # model's rounding, so the bounds are shares of it)
    n = plain.usage.completion_tokens
    for prediction, least in ((text, 3 * (n - 2) // 4), (edited, (n - 2) // 3)):
        got = app_engine.greedy_chat(client, messages, 40, prediction={"type": "content", "content": prediction})
        details = got.usage.completion_tokens_details
        assert got.choices[0].message.content == text
        assert details.accepted_prediction_tokens >= least, details
        assert got.timings["draft_sources"]["prediction"]["accepted"] == details.accepted_prediction_tokens  # type: ignore[attr-defined]
        assert got.timings["predicted_n"] == plain.timings["predicted_n"]  # type: ignore[attr-defined]

    prompt = "Count: one, two, three, four, five, six, seven,"
    base = http.post("/completion", json={"prompt": prompt, "n_predict": 24, "temperature": 0,
                                          "speculative.n_max": 0}).json()
    native = http.post("/completion", json={"prompt": prompt, "n_predict": 24, "temperature": 0,
                                            "prediction": {"type": "content", "content": base["content"]}}).json()
    assert native["content"] == base["content"] and native["timings"]["draft_sources"]["prediction"]["accepted"] > 0
    legacy = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0,
                                       extra_body={"prediction": {"type": "content", "content": base["content"]}})
    assert legacy.choices[0].text == base["content"]
    assert legacy.usage.completion_tokens_details.accepted_prediction_tokens > 0
    bad = http.post("/completion", json={"prompt": prompt, "prediction": {"type": "image", "content": "x"}})
    assert bad.status_code == 400
