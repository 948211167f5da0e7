import pytest

from actors.draft.ngram import NgramConfig, propose_ngram


def test_proposes_what_followed_the_latest_occurrence():
    cfg = NgramConfig(min_n=1, max_n=3, num_speculative_tokens=3)
    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    # The trigram 5 6 7 last occurred at 5..7, followed by 1 2 5.
    assert propose_ngram(seq, cfg) == [1, 2, 5]


def test_longest_ngram_wins_over_a_later_shorter_one():
    cfg = NgramConfig(min_n=1, max_n=2, num_speculative_tokens=2)
    seq = [3, 4, 10, 11, 9, 4, 20, 3, 4]
    # Bigram (3, 4) occurs at 0 -> proposes 10 11, although the unigram 4 occurs later (at 5).
    assert propose_ngram(seq, cfg) == [10, 11]


def test_proposal_is_cut_at_the_end_and_empty_without_match():
    cfg = NgramConfig(min_n=2, max_n=3, num_speculative_tokens=5)
    assert propose_ngram([1, 2, 3, 1, 2], cfg) == [3, 1, 2]
    assert propose_ngram([1, 2, 3, 4, 5], cfg) == []
    assert propose_ngram([7], cfg) == []


def test_bad_config_is_rejected():
    with pytest.raises(ValueError):
        NgramConfig(min_n=0)
    with pytest.raises(ValueError):
        NgramConfig(min_n=3, max_n=2)
