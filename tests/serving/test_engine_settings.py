"""Engine settings (clora.serving.settings) refuse LoRA slot numbers vLLM would refuse."""

from __future__ import annotations

import pytest

from clora.serving.settings import EngineSettings


def test_engine_settings_validate_lora_slots():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineSettings(max_loras=8, max_cpu_loras=4)
