"""ShareGPT salvage, first-turn extraction and the evaluation-overlap filter."""

import json

from vllm_dartree.zoo.sharegpt import exclude_overlaps, first_human_turns, iter_conversations


def _conv(first_from, text, cid):
    return {"id": cid, "conversations": [{"from": first_from, "value": text},
                                         {"from": "gpt", "value": "reply"}]}


def test_truncated_list_yields_the_complete_objects():
    convs = [_conv("human", "How do I sort a list in Python?", "a"),
             _conv("human", "Tell me about the moon landing.", "b")]
    text = json.dumps(convs + [_conv("human", "third one", "c")], indent=2)
    cut = text[: text.rindex("third one") - 10]                       # cut inside the 3rd
    got = list(iter_conversations(cut))
    assert [c["id"] for c in got] == ["a", "b"]
    assert list(iter_conversations(json.dumps(convs))) == convs       # an intact list too


def test_first_human_turns_filters_and_deduplicates():
    convs = [_conv("human", "  Write a haiku about autumn leaves.  ", "1"),
             _conv("gpt", "I start the conversation", "2"),
             _conv("human", "Write a haiku about autumn leaves.", "3"),
             _conv("human", "hi", "4"),
             {"id": "5", "conversations": []}]
    assert first_human_turns(convs) == ["Write a haiku about autumn leaves."]


def test_evaluation_prompts_never_enter_training_data():
    question = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every "
                "morning and bakes muffins for her friends every day with four.")
    prompts = [question, "Please solve: " + question.upper() + " Thanks!",
               "What is the capital of France?", "Write a poem."]
    kept, dropped = exclude_overlaps(prompts, [question, "Write a poem."])
    assert kept == ["What is the capital of France?"] and dropped == 3
