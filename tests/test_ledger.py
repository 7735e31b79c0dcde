"""The ledger of acknowledged steps: a trainer's fates are capped at what it holds."""

from brokers.ledger import ACKED_PARTS, AckLedger


def test_fates_are_capped_at_what_the_reporting_trainer_holds():
    led = AckLedger()
    led.on_acked(b"t1", 10, evaluation=False)
    led.on_acked(b"t2", 5, evaluation=False)
    led.on_acked(b"t1", 3, evaluation=True)  # evaluation steps are never a trainer's to report
    fates = led.on_report(b"t1", {"trained": 8, "dropped_stale": 7, "discarded": 4})
    assert fates == {"trained": 8, "stale": 2, "discarded": 0, "unreadable": 0, "duplicate": 0}
    assert led.held(b"t1") == 0 and led.held(b"t2") == 5  # another trainer's steps are not moved
    assert led.on_report(b"t1", {"trained": 1}) == {"trained": 0, "stale": 0, "discarded": 0, "unreadable": 0, "duplicate": 0}
    fig = led.figures()
    assert fig["over_reported"] == 5 + 4 + 1
    assert fig["acked"] == sum(fig[k] for k in ACKED_PARTS) == 18
    assert led.trainer_gone(b"t2") == 5 and led.figures()["lost_with_trainer"] == 5


def test_a_copy_the_trainer_already_held_is_acknowledged_with_the_fate_duplicate():
    led = AckLedger()
    led.on_acked(b"t1", 8, evaluation=False)  # the copy, re-sent to this (new) broker
    assert led.on_report(b"t1", {"duplicate": 8})["duplicate"] == 8
    fig = led.figures()
    assert fig["held_by_trainers"] == 0 and fig["over_reported"] == 0
    assert fig["acked"] == sum(fig[k] for k in ACKED_PARTS) == 8
