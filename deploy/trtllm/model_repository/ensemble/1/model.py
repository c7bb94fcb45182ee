"""TensorRT-LLM (LLM API, PyTorch backend) behind our ensemble's tensor names.

Runs in NVIDIA's `<yy.mm>-trtllm-python-py3` container with this project installed
(`pip install --no-deps .`). The served configuration is one of the generated YAML files
next to this file, picked with LLM_CONFIG_PATH (baseline.yaml, eagle3.yaml,
draft-target.yaml, ngram.yaml, eagle3-tree.yaml; default eagle3.yaml): keys other than `triton_config` go to
`tensorrt_llm.LLM(...)`, as in TensorRT-LLM's own `llmapi` model; a file with `backend: tensorrt`
(medusa*.yaml, baseline-tensorrt.yaml: 1.2.x runs Medusa on the TensorRT engine backend only) goes to
`tensorrt_llm._tensorrt_engine.LLM` (not yet run on a GPU). Request parsing, the
method check and the perf counters are pure functions in trtllm_repository, tested on the
CPU; this file only moves tensors and drives the LLM's asyncio API.

The LLM runs on an event loop of its own thread (execute() returns at once, decoupled);
one sender thread sends every response, so the loop keeps scheduling while responses go
out, and a request's responses stay in order (each send is awaited).
"""
import asyncio
import concurrent.futures
import functools
import json
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

import specdec_wire as P
from specdec.errors import ConfigError
from trtllm_repository import DEFAULT_CONFIG_FILE, parse_request, perf_counts, served_variant

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_NUMPY = {"TYPE_FP32": np.float32, "TYPE_INT32": np.int32}


def _llm_args(config):
    """model.yaml minus triton_config, with nested blocks turned into TensorRT-LLM's
    config objects (speculative_config -> Eagle3DecodingConfig, ...)."""
    try:
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict
    except ImportError:  # moved between TensorRT-LLM releases
        from tensorrt_llm.llmapi.llm_args import update_llm_args_with_extra_dict
    return update_llm_args_with_extra_dict({}, {k: v for k, v in config.items() if k != "triton_config"})


def _tensor(name, value):
    spec = P.MODELS["ensemble"][1][name]
    if spec.dtype == "TYPE_STRING":
        return pb_utils.Tensor(name, np.array([[value.encode("utf-8")]], dtype=np.object_))
    return pb_utils.Tensor(name, np.array([[value]], dtype=_NUMPY[spec.dtype]))


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        name = os.environ.get("LLM_CONFIG_PATH", DEFAULT_CONFIG_FILE)
        path = os.path.join(args["model_repository"], args["model_version"], name)
        with open(path) as fh:
            config = yaml.safe_load(fh)
        import tensorrt_llm

        self.served = served_variant(config, tensorrt_llm.__version__)
        if model_config["max_batch_size"] != self.served.max_batch_size:
            raise ConfigError(
                "max_batch_size",
                f"config.pbtxt has {model_config['max_batch_size']} but {name} has {self.served.max_batch_size}",
            )
        from tensorrt_llm import SamplingParams

        if config.get("backend") == "tensorrt":
            from tensorrt_llm._tensorrt_engine import LLM
        else:
            from tensorrt_llm import LLM

        self._sampling_params = SamplingParams
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="trtllm-loop", daemon=True)
        self._loop_thread.start()
        self._sender = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trtllm-send")
        self._inflight = set()
        kwargs = _llm_args(config)

        async def build():
            return await asyncio.get_running_loop().run_in_executor(None, lambda: LLM(**kwargs))

        self._llm = asyncio.run_coroutine_threadsafe(build(), self._loop).result()
        pb_utils.Logger.log_info(f"ensemble (TensorRT-LLM): serving {name}: {self.served}")

    def execute(self, requests):
        for request in requests:
            future = asyncio.run_coroutine_threadsafe(self._serve(request), self._loop)
            self._inflight.add(future)
            future.add_done_callback(self._inflight.discard)
        return None

    async def _send(self, sender, response, flags=0):
        await self._loop.run_in_executor(self._sender, functools.partial(sender.send, response, flags=flags))

    def _prompt(self, req):
        if not req.apply_chat_template:
            return req.prompt
        # Token ids, so the template's BOS is not added a second time by the tokenizer.
        tokenizer = getattr(self._llm.tokenizer, "tokenizer", self._llm.tokenizer)
        messages = [{"role": "user", "content": req.prompt}]
        return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))

    def _prompt_text(self, out):
        # As our own ensemble echoes it: the prompt's tokens (chat template included), decoded.
        tokenizer = getattr(self._llm.tokenizer, "tokenizer", self._llm.tokenizer)
        return tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _response(self, text, completion, req, num_input_tokens, num_output_tokens):
        # The LLM API's finish reason ("stop", "length", ...) on the last response, "" before.
        outputs = [_tensor(P.TEXT_OUTPUT, text), _tensor(P.FINISH_REASON, getattr(completion, "finish_reason", None) or "")]
        if req.return_num_input_tokens:
            outputs.append(_tensor(P.NUM_INPUT_TOKENS, num_input_tokens))
        if req.return_num_output_tokens:  # the ids this response carries (TensorRT-LLM's count)
            outputs.append(_tensor(P.NUM_OUTPUT_TOKENS, num_output_tokens))
        if req.return_perf_metrics:
            metrics = getattr(completion, "request_perf_metrics", None)
            spec = getattr(metrics, "speculative_decoding", None)
            counts = perf_counts(
                output_tokens=len(completion.token_ids),
                accepted=int(getattr(spec, "total_accepted_draft_tokens", 0) or 0),
                drafted=int(getattr(spec, "total_draft_tokens", 0) or 0),
            )
            outputs += [_tensor(name, value) for name, value in counts.items()]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    async def _serve(self, request):
        sender = request.get_response_sender()
        try:
            inputs = {}
            for name in P.MODELS["ensemble"][0]:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                inputs[name] = None if tensor is None else tensor.as_numpy()
            req = parse_request(inputs, self.served)
            generation = self._llm.generate_async(
                self._prompt(req), self._sampling_params(**req.sampling), streaming=req.stream
            )
            sent, sent_ids = "", 0
            async for out in generation:
                if request.is_cancelled():
                    generation.abort()
                    error = pb_utils.TritonError("request cancelled by the client", pb_utils.TritonError.CANCELLED)
                    await self._send(sender, pb_utils.InferenceResponse(error=error), FINAL)
                    return
                completion = out.outputs[0]
                if req.stream or out.finished:
                    text = completion.text[len(sent):] if req.stream else completion.text
                    ids = len(completion.token_ids) - sent_ids
                    sent, sent_ids = completion.text, len(completion.token_ids)
                    if not req.stream and not req.exclude_input_in_output:  # TensorRT-LLM's default echo
                        text, ids = self._prompt_text(out) + text, ids + len(out.prompt_token_ids)
                    response = self._response(text, completion, req, len(out.prompt_token_ids), ids)
                    await self._send(sender, response, FINAL if out.finished else 0)
        except Exception as exc:  # every request ends with a final response, errors included
            pb_utils.Logger.log_error(f"ensemble (TensorRT-LLM): {exc}")
            await self._send(sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), FINAL)

    def finalize(self):
        for future in list(self._inflight):
            try:
                future.result(timeout=30)
            except Exception:  # noqa: BLE001 - draining; each request already got its final response
                pass
        self._llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        self._sender.shutdown(wait=True)
