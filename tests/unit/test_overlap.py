"""Held-out hygiene: template twins by masked text (pipeline/assets/overlap.py) and the learning
benchmark's clean training file (benchmarks/bench_learning.py)."""

from __future__ import annotations

import json

import pytest

from pipeline.assets.overlap import masked_text, template_twins
from tests.conftest import load_benchmark


def test_masked_text_masks_numerals_number_words_names_case_and_punctuation():
    assert masked_text("Tom has 5 apples. He eats 2 of his.") == "@ has # apples @ eats # of @"
    assert masked_text("Sara has twenty-one apples; she eats three of her") == "@ has # apples @ eats # of @"
    assert masked_text("It costs $1,250.75 or .5 of it") == "@ costs # or # of it"
    assert masked_text("Five boys ate 1/2 of a cake") == "# boys ate # of a cake"  # a run of numbers is one
    # a word that only contains a number word or a pronoun is a word
    assert masked_text("Tone and often, she thelp") == "@ and often @ thelp"
    with pytest.raises(TypeError, match="expects a string, got int"):
        masked_text(5)


def test_template_twins_catch_other_numbers_and_names_not_other_problems():
    held = ["A chef needs to cook 9 potatoes. He has cooked 7.", "Sam walked 3 miles.",
            "Nancy starts with 91 bottle caps. She finds another 88."]
    train = [
        "A chef needs to cook 13 potatoes. He has already cooked 5.",  # 'already': another text
        "a chef needs to cook 15 potatoes ; he has cooked six",       # twin of held[0] (case aside)
        "Sam walked 3 miles.",                                        # exact duplicate
        "Sam ran 3 miles.",                                           # another verb
        "Evelyn starts with 18 bottle caps. She finds another 63.",   # another name: twin of held[2]
        "",                                                           # empty: never a twin
    ]
    assert [masked_text(t) for t in train[:2]] == ["@ chef needs to cook # potatoes @ has already cooked #",
                                                   "a chef needs to cook # potatoes @ has cooked #"]
    # the first word's case decides whether it is masked: "A chef" and "a chef" differ
    assert template_twins(train, held) == [2, 4]
    assert template_twins(["A chef needs to cook 15 potatoes. He has cooked six."], held) == [0]
    assert template_twins(train, []) == []
    assert template_twins(["", "x"], [""]) == []


def test_clean_training_file_drops_the_twins_and_never_overwrites(tmp_path):
    bench = load_benchmark("bench_learning")
    rows = [{"question": "Sam walked 4 miles.", "gold_answer": "4", "origin": "m-1"},
            {"problem": "Ann has 2 cats and 3 dogs. How many pets?", "gold_answer": "5", "origin": "m-2"},
            {"question": "Bo has 7 cats and a dog.", "gold_answer": "7", "origin": "m-3"}]
    train = tmp_path / "learning-x.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = ["Sam walked 3 miles.", "Ann has 9 cats and 1 dogs. How many pets?"]
    out, rec = bench.remove_heldout_twins(train, held, min_rows=1)
    assert out == tmp_path / "learning-x.heldout-clean.jsonl"
    assert [json.loads(line)["origin"] for line in out.read_text().splitlines()] == ["m-3"]
    assert rec["removed"] == 2 and rec["kept"] == 1 and rec["training_rows"] == 3 and rec["held_out"] == 2
    assert rec["removed_origins"] == ["m-1", "m-2"]
    assert train.read_text().count("\n") == 3  # the given selection is left as it was
    assert bench.remove_heldout_twins(train, held)[0] == out  # the same result again: reused
    with pytest.raises(SystemExit, match="1 of 3 training problems .* fewer than 2"):
        bench.remove_heldout_twins(train, held, min_rows=2)
    out.write_text('{"question": "other"}\n')
    with pytest.raises(SystemExit, match="exists with other rows .* not overwritten"):
        bench.remove_heldout_twins(train, held)
    assert out.read_text() == '{"question": "other"}\n'
