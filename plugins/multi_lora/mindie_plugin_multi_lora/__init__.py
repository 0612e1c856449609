"""mindie-plugin-multi-lora: many LoRA adapters on one base model, mixed in one batch.

Enable it per model with ``"plugin_params": "{\\"plugin_type\\":\\"multi_lora\\"}"``;
adapters come from ``lora_adapter.json`` in the base model directory. See the
package README for the config keys, the management endpoints and the figures.
"""

from __future__ import annotations

__version__ = "0.1.0"
