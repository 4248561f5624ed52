"""KV Lens web app: Gradio wiring only. Runs go through backend.session; figures come from viz.panels."""
from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import gradio as gr

from backend import session
from backend.session import RequestError
from backend.store import TraceStore
from viz import panels

ROOT = Path(__file__).resolve().parent
EXAMPLES = {path.stem.replace("_", " "): path.read_text().strip() for path in sorted((ROOT / "assets" / "examples").glob("*.txt"))}
FIRST_EXAMPLE = next(name for name in ("needle", "story", *EXAMPLES) if name in EXAMPLES)
POLICY_CHOICES = ["full", "window", "sinks", "h2o", "tova", "a2sf", "oracle", "sparq", "reattention"]
DEFAULT_POLICIES = ["sinks", "tova", "a2sf", "reattention"]
DEFAULT_BUDGET = 40
STORE = TraceStore()
NOTES = {name: (ROOT / "assets" / "notes" / f"{name}.md").read_text() for name in
         ("masks", "kept", "curves", "tsne", "divergence", "retention", "sweep")}


def specs_from_controls(names, budget, sinks, alpha, heads, custom):
    """The policy specs the controls describe, plus any typed by hand (one per line)."""
    specs = []
    for name in names or []:
        params = {} if name == "full" else {"budget": int(budget)}
        if name == "sinks":
            params["sinks"] = int(min(sinks, budget - 1))
        if name == "a2sf":
            params["alpha"] = round(float(alpha), 3)
        if name in ("h2o", "tova", "a2sf", "oracle") and heads != "paper default":
            params["heads"] = heads
        if name == "reattention" and budget < DEFAULT_BUDGET:  # shrink its parts so a small scope still fits
            params.update(global_size=min(4, budget // 8), span=max(1, budget // 8), chunk=max(1, budget // 4))
        specs.append(name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else ""))
    specs += [line.strip() for line in (custom or "").splitlines() if line.strip()]
    return specs


def load_run(run_id):
    try:
        return panels.cached_run(run_id, lambda: session.reopen(run_id, STORE))
    except RequestError as err:  # e.g. the run was evicted from the store since
        raise gr.Error(str(err), print_exception=False) from None


def render_run(run_id):
    """The views that depend on the run alone."""
    if not run_id:
        return [None] * 8
    run = load_run(run_id)
    return [panels.summary_table(run), *panels.divergence(run), *panels.retention(run), panels.share_markdown(run)]


def render_views(run_id, layer, head, step, alpha):
    """The views that follow the layer, head and step selectors (t-SNE is computed on demand)."""
    if not run_id:
        return [None] * 4
    run = load_run(run_id)
    step = panels.clamp_step(run, step)
    return [panels.heatmaps(run, layer, head), panels.kept_tokens(run, step, layer, head),
            *panels.score_curves(run, layer, head, alpha, step)]


def on_run(prompt, mode, max_new, names, budget, sinks, alpha, heads, custom, model, progress=gr.Progress()):
    specs = specs_from_controls(names, budget, sinks, alpha, heads, custom)
    request = session.RunRequest(prompt=prompt, specs=specs, mode=mode, max_new_tokens=int(max_new), model=model)
    try:
        run = session.execute(request, STORE, lambda frac, what: progress(frac, desc=what))
    except RequestError as err:
        raise gr.Error(str(err), print_exception=False) from None
    panels.remember(run)
    steps = len(run.traces[0].tokens)
    replayed = "replayed from the store" if all(run.result.replayed) else "computed"
    status = f"{len(run.traces)} policies, {steps} tokens, {replayed}."
    meta = run.full.meta  # the selectors follow the model's shape (allow-listed models differ)
    return (run.run_id, status, gr.update(maximum=steps - 1, value=steps - 1),
            gr.update(choices=panels.layer_choices(meta["n_layers"])),
            gr.update(choices=panels.head_choices(meta["n_kv_heads"])))


def on_sweep(prompt, mode, max_new, names, sinks, alpha, heads, custom, model, progress=gr.Progress()):
    specs = [spec for budget in panels.SWEEP_BUDGETS
             for spec in specs_from_controls(names, budget, sinks, alpha, heads, "")]
    request = session.RunRequest(prompt=prompt, specs=specs, mode=mode, max_new_tokens=int(max_new), model=model)
    try:
        run = session.execute(request, STORE, lambda frac, what: progress(frac, desc=what),
                              max_policies=session.MAX_POLICIES * len(panels.SWEEP_BUDGETS))
    except RequestError as err:
        raise gr.Error(str(err), print_exception=False) from None
    return panels.sweep_figure(run), "Budgets stored: moving the budget slider now replays them instantly."


def on_tsne(run_id, policy, layer, head):
    if not run_id:
        raise gr.Error("Run something first.", print_exception=False)
    try:
        return panels.tsne(load_run(run_id), policy, layer, head)
    except ValueError as err:  # e.g. that policy is not part of this run
        raise gr.Error(str(err), print_exception=False) from None


def on_export(run_id, layer, head, step, alpha):
    if not run_id:
        raise gr.Error("Run something first.", print_exception=False)
    run = load_run(run_id)
    figures = panels.figures_html(run, layer, head, panels.clamp_step(run, step), alpha)
    path = Path(tempfile.mkdtemp(prefix="kvlens-")) / f"kvlens-{run_id[:12]}.zip"
    path.write_bytes(session.export_zip(run, {"figures.html": figures}))
    return str(path)


def on_load(request: gr.Request):
    """Deep link: ?run=<id> reopens a stored run."""
    run_id = (request.query_params or {}).get("run", "") if request else ""
    if not run_id:
        return None, ""
    try:
        run = session.reopen(run_id, STORE)
    except RequestError as err:
        return None, f"**{err}**"
    panels.remember(run)
    return run.run_id, "Opened a shared run from the store."


def build() -> gr.Blocks:
    with gr.Blocks(title="KV Lens") as demo:
        gr.Markdown(panels.INTRO)
        run_id = gr.State(None)
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                prompt = gr.Textbox(label="Prompt", lines=7, value=EXAMPLES[FIRST_EXAMPLE], elem_id="prompt")
                gr.Examples([[text] for text in EXAMPLES.values()], inputs=[prompt], example_labels=list(EXAMPLES),
                            label="Examples")
                mode = gr.Radio([("Generate a continuation", "generate"), ("Score the text (teacher-forced)", "prompt")],
                                value="generate", label="Mode")
                max_new = gr.Slider(4, session.MAX_NEW_TOKENS, value=24, step=4, label="Max new tokens")
                names = gr.CheckboxGroup(POLICY_CHOICES, value=DEFAULT_POLICIES, label="Policies, side by side",
                                         elem_id="policies")
                budget = gr.Slider(4, 128, value=DEFAULT_BUDGET, step=4, label="Budget: cached tokens each query reads",
                                   elem_id="budget")
                with gr.Accordion("Policy parameters", open=False):
                    sinks = gr.Slider(0, 16, value=4, step=1, label="sinks: attention sinks kept (Window+i)")
                    alpha = gr.Slider(0.0, 1.0, value=0.1, step=0.05, label="a2sf: forgetting factor alpha")
                    heads = gr.Radio(["paper default", "head", "layer"], value="paper default",
                                     label="h2o / tova / a2sf / oracle: decide per KV head or per layer")
                    custom = gr.Textbox(label="More policies, one spec per line", lines=2,
                                        placeholder="tova:budget=32,heads=head\nh2o:budget=32,recent=8")
                    model = gr.Dropdown(list(session.ALLOWED_MODELS), value=session.DEFAULT_MODEL, label="Model",
                                        info="Hub models load only where the Space has internet.")
                run_button = gr.Button("Run", variant="primary", elem_id="run")
                status = gr.Markdown(elem_id="status")
            with gr.Column(scale=3):
                summary = gr.Dataframe(label="Summary (vs Full)", interactive=False, elem_id="summary")
                with gr.Row():
                    layer = gr.Dropdown(panels.layer_choices(), value="all", label="Layer", elem_id="layer")
                    head = gr.Dropdown(panels.head_choices(), value="all", label="KV head", elem_id="head")
                    step = gr.Slider(0, 64, value=64, step=1, label="Step (for kept tokens and score curves)")
                with gr.Tabs():
                    with gr.Tab("Masks"):
                        gr.Markdown(NOTES["masks"])
                        heatmap = gr.Plot(elem_id="heatmap")
                    with gr.Tab("Kept tokens"):
                        gr.Markdown(NOTES["kept"])
                        kept = gr.HTML(elem_id="kept")
                    with gr.Tab("A2S vs A2SF"):
                        gr.Markdown(NOTES["curves"])
                        curve_alpha = gr.Slider(0.0, 1.0, value=0.3, step=0.05, label="alpha for A2SF")
                        curves = gr.Plot(elem_id="curves")
                        curves_steps = gr.Plot(elem_id="curves-steps")
                    with gr.Tab("K-cache t-SNE"):
                        gr.Markdown(NOTES["tsne"])
                        with gr.Row():
                            tsne_policy = gr.Dropdown(POLICY_CHOICES, value="tova", label="Policy")
                            tsne_button = gr.Button("Compute t-SNE")
                        tsne_plot = gr.Plot(elem_id="tsne")
                    with gr.Tab("Divergence"):
                        gr.Markdown(NOTES["divergence"])
                        divergence_plot = gr.Plot(elem_id="divergence")
                        continuations = gr.HTML(elem_id="continuations")
                    with gr.Tab("Retention"):
                        gr.Markdown(NOTES["retention"])
                        first_token_plot = gr.Plot(elem_id="first-token")
                        non_recent_plot = gr.Plot(elem_id="non-recent")
                        retention_plot = gr.Plot(elem_id="retention")
                        pos_table = gr.Dataframe(label="Mean lifetime by part of speech", interactive=False)
                    with gr.Tab("Sweep"):
                        gr.Markdown(NOTES["sweep"])
                        sweep_button = gr.Button("Compute every budget")
                        sweep_status = gr.Markdown()
                        sweep_plot = gr.Plot(elem_id="sweep")
                    with gr.Tab("Share"):
                        share = gr.Markdown(elem_id="share")
                        gr.Markdown("The zip holds every trace (npz arrays + json metadata, as `docs/trace-format.md` "
                                    "describes) and `figures.html` with the current views; each plot's camera "
                                    "button saves a PNG.")
                        export_button = gr.Button("Download traces and figures (zip)")
                        export_file = gr.File(label="Traces")

        run_views = [summary, divergence_plot, continuations, first_token_plot, non_recent_plot, retention_plot,
                     pos_table, share]
        views = [heatmap, kept, curves, curves_steps]
        selectors = [run_id, layer, head, step, curve_alpha]
        run_inputs = [prompt, mode, max_new, names, budget, sinks, alpha, heads, custom, model]
        # Moving the budget re-runs too: replayed from the store when that budget was computed before.
        for trigger in (run_button.click, budget.change):
            trigger(on_run, run_inputs, [run_id, status, step, layer, head], concurrency_id="model",
                    trigger_mode="always_last").then(
                render_run, run_id, run_views).then(render_views, selectors, views)
        for control in (layer, head, curve_alpha):
            control.change(render_views, selectors, views)
        step.release(render_views, selectors, views)
        tsne_button.click(on_tsne, [run_id, tsne_policy, layer, head], tsne_plot)
        sweep_button.click(on_sweep, [prompt, mode, max_new, names, sinks, alpha, heads, custom, model],
                           [sweep_plot, sweep_status], concurrency_id="model")
        export_button.click(on_export, selectors, export_file)
        demo.load(on_load, None, [run_id, status]).then(render_run, run_id, run_views).then(
            render_views, selectors, views)
    return demo


demo = build()
demo.queue(default_concurrency_limit=1, max_size=32)

if __name__ == "__main__":
    # Load (and on first use convert) the default model while the page comes up, not on the first click.
    threading.Thread(target=session.get_model, daemon=True).start()
    demo.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
                server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
                css_paths=[ROOT / "assets" / "style.css"])
