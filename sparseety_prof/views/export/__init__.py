"""Exports of a recording for other tools: `perfetto` (Chrome trace-event JSON that ui.perfetto.dev
and chrome://tracing open: steps per engine thread, tokens per request, GPU kernels, flow arrows)
and `jsonl` (one JSON object per token, the brief's event shape). Both stream: rows are converted
and written a slice at a time, never held as one list of Python objects."""
