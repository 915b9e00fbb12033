"""The style sheet of ``worldloop show``'s page (one self-contained HTML file)."""

CSS = """
:root{--fg:#1c2230;--muted:#596275;--bg:#f4f5f7;--card:#fff;--line:#dcdfe5;--ok:#16794a;--bad:#b3261e;
--accent:#2153b8;--soft:#eef2fb;--warn:#8a5a00;--warnbg:#fff6e0}
*{box-sizing:border-box}
html{font-size:16px;-webkit-text-size-adjust:100%}
body{margin:0;background:var(--bg);color:var(--fg);
font:1rem/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","DejaVu Sans",Arial,sans-serif;
overflow-wrap:anywhere}
main{max-width:1320px;margin:0 auto;padding:1rem clamp(.75rem,2vw,1.75rem) 3rem}
h1{font-size:1.5rem;margin:.5rem 0 .25rem}
h2{font-size:1.2rem;margin:0}
h3{font-size:.8rem;margin:0 0 .25rem;color:var(--muted);text-transform:uppercase;letter-spacing:.04em}
a{color:var(--accent)}
.muted{color:var(--muted)}
pre{white-space:pre-wrap;overflow-wrap:anywhere;word-break:break-word;margin:0;
font:.875rem/1.45 ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace}
.prose{white-space:pre-wrap;overflow-wrap:anywhere;margin:0;font-size:.95rem;line-height:1.45}
table{border-collapse:collapse}
.summary{display:flex;flex-wrap:wrap;gap:.5rem 1.5rem;margin:.5rem 0 1rem}
.toc{width:100%;background:var(--card);border:1px solid var(--line);border-radius:8px;font-size:.95rem}
.toc th,.toc td{padding:.3rem .6rem;border-bottom:1px solid var(--line);text-align:left}
.toc td.num,.toc th.num{text-align:right;font-variant-numeric:tabular-nums}
.episode{background:var(--card);border:1px solid var(--line);border-radius:10px;margin:1.25rem 0;
padding:1rem clamp(.75rem,1.5vw,1.25rem)}
.episode>header{display:flex;flex-wrap:wrap;align-items:baseline;gap:.4rem 1rem;padding-bottom:.5rem}
.badge{display:inline-block;padding:.05rem .55rem;border-radius:999px;font-size:.85rem;font-weight:600;
color:#fff;background:var(--muted)}
.badge.ok{background:var(--ok)}.badge.bad{background:var(--bad)}
.turn{display:grid;grid-template-columns:minmax(0,22rem) minmax(0,1fr);gap:1rem 1.25rem;
border-top:1px solid var(--line);padding:1rem 0 .5rem}
.turn-head{grid-column:1/-1;display:flex;flex-wrap:wrap;gap:.3rem 1rem;align-items:baseline}
.turn-head strong{font-size:1.05rem}
.media figure{margin:0 0 .5rem}
.media img{display:block;width:100%;max-width:22rem;height:auto;border:1px solid var(--line);border-radius:6px;
background:#000}
.media img.px{image-rendering:pixelated}
.media .none{padding:1rem;border:1px dashed var(--line);border-radius:6px;color:var(--muted)}
.pair{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:.6rem;margin-bottom:.6rem}
.box{background:var(--soft);border-radius:6px;padding:.5rem .65rem;min-width:0}
.box.truth{background:#eef7f1}
.box .empty{color:var(--muted);font-style:italic}
.facts{display:flex;flex-wrap:wrap;gap:.35rem .6rem;align-items:center;margin:.4rem 0}
.chip{display:inline-block;border:1px solid var(--line);border-radius:6px;padding:.05rem .45rem;
font-size:.9rem;background:#fff;font-variant-numeric:tabular-nums}
.chip b{font-weight:600}
.action{background:#e8eefc;border-color:#c7d4f5}
.facts h3{margin:0 .2rem 0 0}
.reward b{font-weight:700}
.judge dl{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:.1rem .75rem;margin:.25rem 0}
.judge dt{color:var(--muted)}.judge dd{margin:0}
details{margin:.35rem 0}
summary{cursor:pointer;color:var(--accent)}
.note{background:var(--warnbg);color:var(--warn);border-radius:6px;padding:.35rem .6rem;margin:.4rem 0}
.failure{background:#fdecea;color:var(--bad);border-radius:6px;padding:.35rem .6rem;margin:.4rem 0}
@media (max-width:900px){.turn{grid-template-columns:minmax(0,1fr)}.media img{max-width:min(100%,20rem)}}
@media (max-width:620px){.pair{grid-template-columns:minmax(0,1fr)}html{font-size:15px}}
"""
