"""The OpenAI layer's request models: a logits processor's field the request does not declare is derived from
SamplingSettings (protocol.settings_fields), so that adding a sampling field touches generation/settings.py,
generation/processors.py and the CLI's option, and the API and the offline API take it as they are."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ValidationError, create_model

from gpt2x.generation.processors import LogitsProcessor
from gpt2x.serve.openai.protocol import SamplingRequest, settings_fields


@dataclass(frozen=True)
class NewSettings:
    """A stand-in for SamplingSettings with two fields no request declares."""

    xtc_probability: float = 0.0
    xtc_keep: tuple[str, ...] = ()
    xtc_rounds: int = 1


class Xtc(LogitsProcessor):
    fields = ("xtc_probability", "xtc_keep", "xtc_rounds", "temperature", "constraint")


def test_a_new_processors_fields_are_request_fields_of_their_settings_types():
    fields = settings_fields(SamplingRequest.model_fields, NewSettings, [Xtc])
    assert set(fields) == {"xtc_probability", "xtc_keep", "xtc_rounds"}  # temperature is declared; constraint its own
    Request = create_model("Request", __base__=SamplingRequest, **fields)
    body = Request.model_validate({"xtc_probability": 0.5, "xtc_keep": ["a", "b"], "xtc_rounds": 2.0})
    assert (body.xtc_probability, body.xtc_keep, body.xtc_rounds) == (0.5, ["a", "b"], 2)
    assert Request.model_validate({}).xtc_probability is None  # null: the settings' default
    for bad in ({"xtc_probability": "0.5"}, {"xtc_keep": "a"}, {"xtc_rounds": 2.5}, {"xtc_rounds": True}):
        with pytest.raises(ValidationError) as e:
            Request.model_validate(bad)
        assert e.value.errors()[0]["loc"][0] == next(iter(bad))
    schema = Request.model_json_schema()["properties"]
    assert schema["xtc_keep"]["anyOf"][0] == {"type": "array", "items": {"type": "string"}}
    assert schema["xtc_rounds"]["anyOf"][0] == {"type": "integer"}


def test_every_processor_field_is_declared_today():
    """Today's fields are declared by hand (with their bounds and descriptions): nothing is derived."""
    from gpt2x.serve.openai.protocol import _SamplingFields

    assert settings_fields(_SamplingFields.model_fields) == {}
