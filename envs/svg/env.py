"""SVG reconstruction (VAGEN App. A.4 Tables 14/15/20, App. B.2 prompt): ``worldloop/SVG-v0``.

The agent sees a target image rendered from SVG code and answers SVG code that reproduces it; the
turn's reward is ``similarity_weight`` (5.0, Table 20's DreamSim weight) x the similarity of its
rendering to the target. After a turn the observation image is the agent's own rendering (blank
white after a rejected answer), as in VAGEN's env; the text reports the similarity.

Targets (``source``): ``"generated"`` (the default without ``dataset_dir``) draws icons from
:func:`worldloop.envs.svg.icons.generate_icon` (``info["task"] == "icon"``); ``"dataset"`` (the default with
``dataset_dir``) loads a local copy of an icon dataset such as ``starvector/svg-icons-simple`` with
:func:`worldloop.envs.svg.icons.load_svg_dataset` (``info["task"] == "dataset"``; the episode's icon is
``items[seed-driven index]``). ``reset(options={"svg": code, "name": name})`` sets a given target.

Similarity (``metric``, see :mod:`worldloop.envs.svg.metrics`): ``"pixel"`` (default; multi-scale normalised
cross-correlation x (1 - mean abs error), no download, reported as ``pixel_similarity``), ``"dino"``,
``"dreamsim"`` (local weights only) or ``"auto"``. ``info["metrics"]`` holds ``similarity`` plus the
metric's own names (``pixel_similarity``/``pixel_ncc``/``pixel_mae``, or ``dreamsim``/``dino``) for the
current canvas (0.0 after a rejected answer); it is empty before the first answer.

Answers: the ``<answer>`` must contain one SVG document (``<svg ...>...</svg>``; text around it is
ignored). It is validated and rendered by :mod:`worldloop.envs.svg.render` (no DTD/entities, no scripts or
external references, bounded size/elements/depth/coordinates, rendering in a separate process killed
after ``render_timeout_s``). A rejected or unrenderable SVG is a **format failure**: no format
reward, no env reward, nothing executed, ``info["reason"]`` says why (VAGEN gives an invalid SVG
no format reward either), and the canvas becomes blank (similarity 0).

Episodes: one answer per turn (``max_actions_per_step`` is 1); ``success`` when the similarity
reaches ``success_similarity`` (0.95), which ends the episode; no success bonus and no step penalty
(Table 20 has neither); ``max_steps`` (10) answers truncate.

State, and what observation/prediction mean here (following the paper's SVG prompts, whose
observation describes the image's elements and whose prediction describes the expected rendering
and similarity), the state is what the agent's image shows: before the first answer, sentences about
the target's elements (``"the target image has a red circle centered at (25, 25) with radius 15, at
the top-left"``); after an answer, ``"the generated image has similarity 0.87 to the target"`` and
sentences about the rendered elements (``"the generated image has a ..."``), or that the canvas is
blank. ``structured`` = ``{"viewbox": [x, y, w,
h], "target_elements": [{"shape", "fill", "stroke", "bbox", ...}], "similarity": float | None,
"generated_elements": [...]}``; ``symbolic`` is None. The judge scores ``<observation>`` (what the
agent sees: the target at the first turn, its own rendering later) against the state before the
turn and ``<prediction>`` (the rendering it expects and its similarity) against the state after.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from worldloop.envs.base import ActionResult, VisualEnv
from worldloop.envs.parsing import ActionParse
from worldloop.envs.svg.icons import generate_icon, load_svg_dataset
from worldloop.envs.svg.metrics import make_metric
from worldloop.envs.svg.describe import describe_svg, element_sentence
from worldloop.envs.svg.render import (DEFAULT_TIMEOUT_S, MAX_BYTES, SVGRejected, SVGRenderError, extract_svg,
                                       render_svg, validate_svg)

_MAX_SENTENCES = 12


class _Rendered:
    """A validated answer and its rendering (the value handed to ``_apply_action``)."""

    __slots__ = ("code", "image", "elements")

    def __init__(self, code: str, image: np.ndarray, elements: dict) -> None:
        self.code, self.image, self.elements = code, image, elements


def _sentences(prefix: str, desc: dict) -> list[str]:
    els = desc["elements"]
    out = [f"{prefix} has {element_sentence(e, desc['viewbox'])}" for e in els[:_MAX_SENTENCES]]
    if len(els) > _MAX_SENTENCES:
        out.append(f"{prefix} has {len(els) - _MAX_SENTENCES} more elements")
    if not els:
        out.append(f"{prefix} is empty")
    return out


class SVGEnv(VisualEnv):
    ACTIONS: tuple[str, ...] = ()
    ACTION_SEP = "~"
    STATE_FORMATS_SUPPORTED = ("natural_language", "structured")
    DEFAULT_MAX_ACTIONS_PER_STEP = 1
    DEFAULT_MAX_STEPS = 10
    DEFAULT_IMAGE_SIZE = 256
    SUCCESS_REWARD = 0.0
    STEP_PENALTY = 0.0

    def __init__(self, *, source: str | None = None, dataset_dir: str | None = None, metric: str = "pixel",
                 similarity_weight: float = 5.0, success_similarity: float = 0.95,
                 render_timeout_s: float = DEFAULT_TIMEOUT_S, max_svg_bytes: int = MAX_BYTES,
                 dino_model: str | None = None, dreamsim_cache_dir: str | None = None,
                 max_actions_per_step: int | None = None, **common: Any) -> None:
        if max_actions_per_step not in (None, 1):
            raise ValueError(f"max_actions_per_step must be 1 for SVG (one SVG per answer), got {max_actions_per_step!r}")
        if source is None:
            source = "dataset" if dataset_dir else "generated"
        if source not in ("generated", "dataset"):
            raise ValueError(f"source must be 'generated' or 'dataset', got {source!r}")
        if source == "dataset" and not dataset_dir:
            raise ValueError("source='dataset' needs dataset_dir=<local directory or JSON/JSONL file>")
        for name, value, lo, hi in (("similarity_weight", similarity_weight, 0.0, 1000.0),
                                    ("success_similarity", success_similarity, 0.0, 1.0),
                                    ("render_timeout_s", render_timeout_s, 0.05, 120.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
        if isinstance(max_svg_bytes, bool) or not isinstance(max_svg_bytes, int) or not 256 <= max_svg_bytes <= 1 << 20:
            raise ValueError(f"max_svg_bytes must be an int in [256, 1048576], got {max_svg_bytes!r}")
        super().__init__(max_actions_per_step=1, **common)
        self.metric_name, self._metric = make_metric(metric, dino_model=dino_model,
                                                     dreamsim_cache_dir=dreamsim_cache_dir)
        self.source = source
        self.dataset = load_svg_dataset(dataset_dir) if source == "dataset" else None
        self.similarity_weight = float(similarity_weight)
        self.success_similarity = float(success_similarity)
        self.render_timeout_s = float(render_timeout_s)
        self.max_svg_bytes = int(max_svg_bytes)
        self.task = "icon" if source == "generated" else "dataset"
        self.target_name = ""
        self.target_code = ""
        self.target_image: np.ndarray | None = None
        self.target_desc: dict = {"viewbox": [0, 0, 100, 100], "elements": []}
        self._canvas: _Rendered | None = None
        self._scores: dict[str, float] = {}
        self._answered = False
        self._prev_canvas: _Rendered | None = None

    # ------------------------------------------------------------------ episode

    def _generate(self, rng: np.random.Generator, options: dict | None) -> None:
        if options and options.get("svg"):
            name, code = str(options.get("name", "custom")), str(options["svg"])
        elif self.dataset is not None:
            name, code = self.dataset.items[int(rng.integers(len(self.dataset.items)))]
        else:
            code = generate_icon(rng)
            name = "icon"
        root = validate_svg(code, max_bytes=max(self.max_svg_bytes, MAX_BYTES))
        self.target_name, self.target_code = name, code
        self.target_image = render_svg(code, self.image_size, self.render_timeout_s)
        self.target_desc = describe_svg(root)
        self._canvas = None
        self._scores = {}
        self._answered = False

    def _parse_actions(self, answer: str) -> ActionParse:
        if len(answer or "") > self.max_svg_bytes:
            return ActionParse(reason=f"invalid SVG: answer longer than {self.max_svg_bytes} characters")
        code = extract_svg(answer)
        if code is None:
            return ActionParse(reason="invalid SVG: no <svg ...>...</svg> in the answer")
        try:
            root = validate_svg(code, max_bytes=self.max_svg_bytes)
            image = render_svg(code, self.image_size, self.render_timeout_s)
        except (SVGRejected, SVGRenderError) as e:
            return ActionParse(reason=f"invalid SVG: {e}")
        return ActionParse([code], [_Rendered(code, image, describe_svg(root))])

    def step(self, response: Any):
        if not self._done and self._was_reset:
            # a turn that renders nothing leaves a blank canvas (VAGEN shows a white image)
            self._prev_canvas = self._canvas
            self._canvas = None
            self._scores = {"similarity": 0.0}
            self._answered = True
            self._state_cache = None
        return super().step(response)

    def _apply_action(self, value: _Rendered) -> ActionResult:
        prev = self._prev_canvas if self._canvas is None else self._canvas
        scores = {k: float(v) for k, v in self._metric(value.image, self.target_image).items()}
        self._canvas, self._scores, self._answered = value, scores, True
        changed = prev is None or not np.array_equal(prev.image, value.image)
        return ActionResult(changed, self.similarity_weight * scores["similarity"])

    def _is_success(self) -> bool:
        return self._canvas is not None and self._scores.get("similarity", 0.0) >= self.success_similarity

    def _metrics(self) -> dict[str, float]:
        return dict(self._scores) if self._answered else {}

    def _get_state(self) -> dict:
        structured: dict = {"viewbox": self.target_desc["viewbox"], "target_elements": self.target_desc["elements"],
                            "similarity": None, "generated_elements": []}
        if not self._answered:  # the agent sees the target
            return {"relations": _sentences("the target image", self.target_desc), "symbolic": None,
                    "structured": structured}
        sim = round(self._scores.get("similarity", 0.0), 3)
        structured["similarity"] = sim
        if self._canvas is None:  # the agent sees a blank canvas
            relations = ["the generated image is blank (no valid SVG was rendered), similarity 0.00 to the target"]
        else:  # the agent sees its own rendering
            relations = [f"the generated image has similarity {sim:.2f} to the target"]
            relations += _sentences("the generated image", self._canvas.elements)
            structured["generated_elements"] = self._canvas.elements["elements"]
        return {"relations": relations, "symbolic": None, "structured": structured}

    def _snapshot(self) -> Any:
        return (self._canvas, dict(self._scores), self._answered, self._prev_canvas)

    def _restore(self, snap: Any) -> None:
        self._canvas, scores, self._answered, self._prev_canvas = snap
        self._scores = dict(scores)
        self._state_cache = None

    # ------------------------------------------------------------------ observations

    def _observation(self, initial: bool) -> dict:
        # name the accepted answer instead of echoing the whole SVG document back to the agent
        saved = self._last_actions
        if saved:
            self._last_actions = [f"your SVG code ({len(saved[0])} characters)"]
        try:
            return super()._observation(initial)
        finally:
            self._last_actions = saved

    def _render_image(self) -> np.ndarray:
        if not self._answered:
            return self.target_image
        if self._canvas is None:
            return np.full((self.image_size, self.image_size, 3), 255, dtype=np.uint8)
        return self._canvas.image

    def _render_text(self) -> str:
        if not self._answered:
            return "The target image contains " + "; ".join(
                element_sentence(e, self.target_desc["viewbox"]) for e in self.target_desc["elements"]) + "."
        if self._canvas is None:
            return "Your answer rendered nothing: the canvas is blank."
        return "Your SVG rendered an image that contains " + "; ".join(
            element_sentence(e, self._canvas.elements["viewbox"]) for e in self._canvas.elements["elements"]) + "."

    def _turn_context(self) -> str:
        ask = "Please carefully observe the image, and generate SVG code that reproduces it as accurately as possible."
        if not self._answered:
            return ask
        if self._canvas is None:
            return f"Your last answer was not a valid SVG, so nothing was drawn (similarity 0.00).\n{ask}"
        sim = self._scores.get("similarity", 0.0)
        return (f"The image above is the rendering of your SVG code; its similarity to the target image is "
                f"{sim:.2f} (1.00 = identical).\nImprove your SVG code so that it reproduces the target image "
                "as accurately as possible.")

    def describe_state(self, state) -> str:
        if self.state_format == "structured":
            return json.dumps(state.get("structured") or {}, separators=(", ", ": "))
        return super().describe_state(state)

    # ------------------------------------------------------------------ expert

    def _expert_actions(self) -> list[str]:
        return [self.target_code]

    def _expert_reasoning(self, actions: Sequence[str]) -> str:
        n = len(self.target_desc["elements"])
        w, h = (_num(v) for v in self.target_desc["viewbox"][2:4])
        return (f"The image has {n} element(s); I reproduce each one with the same shape, color, position and "
                f"size in a {w} x {h} view box.")

    # ------------------------------------------------------------------ prompts

    def _system_intro(self) -> str:
        return (
            "You are a precise SVG code generator.\n"
            "SVG Quick Guide\n"
            "Goal: Transform the provided image into precise SVG code that replicates the image.\n"
            "Process:\n"
            "1. First analyze the image carefully, identifying distinct visual elements\n"
            "2. Identify colors, dimensions, positions, and relationships between elements\n"
            "3. Generate accurate SVG code that reproduces the image, you can use path for better shape\n"
            "Rewards:\n"
            f"- Overall visual similarity: +{self.similarity_weight:g} x similarity (0 to 1)\n"
            "- Format correct (a valid SVG in the required format): +0.5\n"
            "Rules: one <svg> document per answer; no scripts, external references, images or entity "
            "declarations (such answers are rejected)."
        )

    def _action_line(self) -> str:
        return "Answer with exactly one SVG document (<svg ...>...</svg>) inside <answer>."

    def _state_format_hint(self) -> str:
        if self.state_format == "structured":
            return ('Write the observation and the prediction as a JSON dictionary with "elements": a list of '
                    '{"shape", "fill", "bbox": [x0, y0, x1, y1]}, and in the prediction the expected "similarity".')
        return ("Both the observation and prediction should describe what you see or expect to see: the shapes, "
                "their colors, positions and sizes, and in the prediction how similar the rendering will be.")

    def _example_fields(self) -> dict[str, str]:
        code = ('<svg viewBox="0 0 100 100" xmlns="http://www.w3.org/2000/svg"><circle cx="20" cy="25" r="15" '
                'fill="red" /><rect x="60" y="60" width="35" height="20" fill="blue" /></svg>')
        if self.state_format == "structured":
            obs = json.dumps({"elements": [{"shape": "circle", "fill": "red", "bbox": [10, 10, 40, 40]},
                                           {"shape": "rectangle", "fill": "blue", "bbox": [60, 60, 90, 80]}]})
            pred = json.dumps({"elements": [{"shape": "circle", "fill": "red", "bbox": [5, 10, 35, 40]},
                                            {"shape": "rectangle", "fill": "blue", "bbox": [60, 60, 95, 80]}],
                               "similarity": 0.98})
        else:
            obs = ("I can see an image containing a red circle positioned at the top-left area of the canvas, "
                   "approximately at coordinates (25, 25) with a radius of 15 units. There is also a blue rectangle "
                   "at the bottom-right area, sized about 30x20 units and positioned at coordinates (60, 60).")
            pred = ("After implementing these adjustments, the resulting SVG should more closely match the original "
                    "image. I expect the similarity score to improve to approximately 0.98.")
        return {"observation": obs, "prediction": pred,
                "reasoning": ("The circle appears to be slightly too far right, so I should adjust its x-coordinate to "
                              "20 instead of 25. The rectangle could benefit from being slightly wider."),
                "think": "I can see a red circle at the top-left and a blue rectangle at the bottom-right.",
                "answer": code}


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"
