"""GLANCE in Triton's Python backend; `glance-export triton` copies this file to REPO/glance/1/model.py.

One instance is one stub process with one runner. Where the graphs were exported for batches it
decodes requests together (parameter `max_batch`; unset: glance-serve's default for what is served): each
request of an `execute` call is handed to the runtime's batch thread and answered from there as it finishes,
so requests of later calls join the running batch; each answer is the one decoded alone. At max_batch 1 it
decodes one request at a time. The model is decoupled: a request with the parameter `"stream": true` gets its text as pieces while rounds commit
(for `generate_stream`), any other request one response with the whole text (what `generate` requires:
Triton's generate endpoint refuses a model that answers with more than one response).
A request may sample (`temperature`, `top_p`, `top_k`, `min_p`, `seed`): the same
tokens as glance-run with the same settings and seed, draft on or off, alone or in the batch.
Parameters in config.pbtxt name what to serve (artifacts, engines or model and head; none: the embedded
default) and where the runtime imports from when the stub's environment does not install it.
"""
import base64
import binascii
import io
import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)[0]


def _response(text):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text", np.array([text.encode("utf-8")], dtype=np.object_))])


def decoded_image(data):
    """The picture a request's image bytes hold, as glance-run and glance-serve see the same file (the runtime's one
    conversion to RGB: transparency on white, wide greys scaled)."""
    from PIL import Image

    from glance_runtime.prompt.images import to_rgb

    try:
        with Image.open(io.BytesIO(data)) as img:
            return to_rgb(img)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        raise ValueError("image is not an image Pillow can decode; send a PNG, JPEG or WebP file's bytes "
                         "base64-encoded")


def _text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        if args.get("model_instance_kind") == "GPU":
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(args["model_instance_device_id"]))
        try:
            import glance_runtime  # noqa: F401
        except ImportError:
            sys.path.insert(0, params["runtime_root"])
        from pathlib import Path

        from glance_runtime.errors import GlanceError
        from dataclasses import replace

        from glance_runtime.serve.engine import Cancelled, Engine, ModelSpec, default_batch

        def path(key):
            return Path(params[key]) if params.get(key) else None

        providers = params.get("providers")
        spec = ModelSpec(model=path("model"), head=path("head"), artifacts=path("artifacts"), engines=path("engines"),
                         backend=params.get("backend") or None, providers=providers.split(",") if providers else None)
        spec = replace(spec, max_batch=int(params["max_batch"]) if params.get("max_batch") else default_batch(spec))
        self.max_tokens = int(params.get("max_tokens", "1024"))
        self.errors = (GlanceError, Cancelled)
        self.batched = spec.max_batch > 1
        self.engine = Engine(spec)
        self.engine.warm()

    def _messages(self, request):
        prompt = _text(_input(request, "prompt"))
        content = []
        image = _input(request, "image")
        if image is not None:  # present but empty is refused: answering without the image would be a wrong answer
            if not len(image):
                raise ValueError("image is empty; send the image file's bytes base64-encoded, or leave the image "
                                 "field out for a text-only prompt")
            try:
                data = base64.b64decode(image, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("image is not valid base64; send the image file's bytes base64-encoded")
            content.append({"type": "image", "image": decoded_image(data)})
        content.append({"type": "text", "text": prompt})
        return [{"role": "user", "content": content}]

    def _respond(self, request):
        sender = request.get_response_sender()
        try:
            limit = _input(request, "max_tokens")
            limit = 256 if limit is None else int(limit)
            if not 1 <= limit <= self.max_tokens:
                raise ValueError(f"max_tokens must be 1..{self.max_tokens} (got {limit})")
            sampling = self._sampling(request)
            prompt = self.engine.prepare(self._messages(request), limit)
            stream = json.loads(request.parameters() or "{}").get("stream") is True

            def emit(piece):
                sender.send(_response(piece))

            decode = (prompt, limit, (), emit if stream else None, sender.is_cancelled, sampling)
            if self.batched:  # answered from the batch thread once it finishes; execute() moves on at once
                self.engine.start(*decode).add_done_callback(lambda done: self._finish(sender, stream, done.result))
            else:
                self._finish(sender, stream, lambda: self.engine.complete(*decode))
        except (ValueError, *self.errors) as exc:
            self._fail(sender, exc)

    @staticmethod
    def _sampling(request):
        """The request's sampling settings (absent: greedy; temperature above 0 without a seed draws one): the
        tokens glance-run samples with the same settings and seed."""
        from glance_runtime.decode.sampling import sampling_params

        given = {name: _input(request, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed")}
        defaults = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None}
        # an FP32 input as the number the client wrote (0.95, not 0.949999988), as glance-run reads its flags
        return sampling_params(**{k: defaults[k] if v is None else float(str(v)) if isinstance(v, np.floating) else v
                                  for k, v in given.items()})

    def _finish(self, sender, stream, completion):
        """The final response: the whole text, or the end of a stream; or the decode's error."""
        try:
            done = completion()
        except self.errors as exc:
            self._fail(sender, exc)
            return
        if stream:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            sender.send(_response(done.text), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _fail(sender, exc):
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        for request in requests:
            self._respond(request)
        return None

    def finalize(self):
        self.engine.close()
