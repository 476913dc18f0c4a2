"""Run-wide draft counters are this run's only when the servers served this run alone
(:func:`specparity.judge.traffic.unattributed`)."""

from __future__ import annotations

from specparity.judge.traffic import OTHER_TRAFFIC, unattributed
from specparity.model.traffic import Traffic

SOURCE = "vllm:request_success_total, vllm:generation_tokens_total at http://s"


def reading(finished, generated, own_finished, own_generated) -> Traffic:
    return Traffic(finished, generated, own_finished, own_generated, SOURCE)


def test_the_servers_served_this_run_alone():
    assert unattributed(reading(10, 200, 4, 64), reading(15, 280, 9, 144)) is None


def test_more_than_this_run_sent_is_other_traffic():
    why = unattributed(reading(10, 200, 4, 64), reading(16, 296, 9, 144))
    assert why == (f"{OTHER_TRAFFIC}: during the speculative phase the speculative servers finished 6 request(s) and "
                   f"generated 96 token(s), this run sent them 5 and got 80 back ({SOURCE}); their draft counters may "
                   "count another client's drafts, so they say nothing about this run's")
    # the same requests, more tokens (another client's request finished in the meantime as an abort)
    assert unattributed(reading(10, 200, 4, 64), reading(15, 281, 9, 144)).startswith(OTHER_TRAFFIC)


def test_nothing_to_rule_other_traffic_out_is_unknown():
    assert unattributed(None, None).startswith(f"{OTHER_TRAFFIC} cannot be ruled out: the engine's run-wide draft "
                                               "counters come without")
    hidden = unattributed(reading(None, None, 0, 0), reading(None, None, 5, 80))
    assert hidden == (f"{OTHER_TRAFFIC} cannot be ruled out: the servers do not expose their count of finished "
                      f"requests and generated tokens ({SOURCE})")


def test_a_reading_round_trips_through_the_journal():
    r = reading(3, 40, 2, 30)
    assert Traffic.from_json(r.to_json()) == r and Traffic.from_json(None) is None
