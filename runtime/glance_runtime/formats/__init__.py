"""Every file GLANCE writes and reads again, one module per format: its typed schema, its FORMAT name and
VERSION, and the one reader and writer. A reader refuses anything else (missing, foreign, older or newer,
malformed, out of range) in one GlanceError line naming the file and the fix, so no wrong value reaches a
graph runtime.

- `artifacts`: an artifacts directory's manifest.json (`glance-export onnx`)
- `engines`: an engines directory's engines.json (`glance-export build`)
- `cost`: a cost profile (`--budget auto`, `glance-bench cost`)
- `reference`: a recorded fp32 greedy reference (`glance-export audit --save-reference`)
- `rounds`: a round log, rounds.jsonl (`glance-bench`)
- `tasks`: a task file, TASKS.jsonl (written by hand or by `glance-export corpus`)
- `common`: the strict JSON and JSON-lines readers and field checks they share

calibration.json (`glance-bench calibrate`) is the one format defined outside this package, in
`glance_runtime.decode.calibration`: its dataclass is auto's acceptance model as much as a schema.
"""
