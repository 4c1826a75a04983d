"""The acceleration contract (manifests/accel): parsing, canonical labels, refusals with one clear message."""

import pytest

from manifests.accel import AccelKind, AccelSpecError, Knob, get_kind, kinds, make_spec, parse_accel


def test_every_kind_round_trips_through_its_label():
    assert kinds(), "no acceleration kinds declared"
    for kind in kinds():
        spec = make_spec(kind.name)
        assert parse_accel(spec.label()) == spec
        assert spec.exact is kind.exact
        assert dict(spec.knobs).keys() == {k.name for k in kind.knobs}
        assert spec.cache_key_part() == (("accel", spec.label()),)


def test_knob_values_are_coerced_and_order_does_not_matter():
    spec = parse_accel("guidance_interval:end=4, start=1")
    assert spec.get("start") == 1 and spec.get("end") == 4
    assert spec == parse_accel("guidance_interval:start=1,end=4")
    assert spec.label() == "guidance_interval:end=4,start=1"
    assert spec != parse_accel("guidance_interval:start=2,end=4")   # a knob change is a different spec (and key)


@pytest.mark.parametrize("text, message", [
    ("", "NAME[:knob=value"),
    ("no_such_accel", "unknown acceleration 'no_such_accel'"),
    ("guidance_interval:bogus=1", "unknown knob 'bogus'"),
    ("guidance_interval:start", "expected knob=value"),
    ("guidance_interval:start=1,start=2", "given twice"),
    ("guidance_interval:start=-1", "must be in [0"),
    ("guidance_interval:start=1.5", "must be int"),
])
def test_bad_specs_are_refused_with_one_message(text, message):
    with pytest.raises(AccelSpecError) as err:
        parse_accel(text)
    assert message in str(err.value)


def test_knob_types_and_choices():
    kind = AccelKind(name="probe", exact=True, summary="", cache_key_fields=(), loops=(),
                     knobs=(Knob("on", False, bool, ""), Knob("x", 0.5, float, "", low=0, high=1),
                            Knob("mode", "a", str, "", choices=("a", "b"))))
    assert kind.knob("on").coerce("probe", "true") is True
    assert kind.knob("x").coerce("probe", "0.25") == 0.25
    for knob, raw in (("on", "maybe"), ("x", "nan"), ("x", "2"), ("mode", "c")):
        with pytest.raises(AccelSpecError):
            kind.knob(knob).coerce("probe", raw)
    with pytest.raises(AccelSpecError, match="unknown knob"):
        kind.knob("y")


def test_get_kind_names_the_known_ones():
    with pytest.raises(AccelSpecError) as err:
        get_kind("nope")
    assert "guidance_interval" in str(err.value)
