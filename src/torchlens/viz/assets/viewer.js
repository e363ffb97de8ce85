// torchlens graph viewer: pan, zoom, search, records, and module drill-down over pre-laid-out SVGs.
// Pictures are stored as inert text in script elements; only the one on screen is parsed into SVG.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("tl-data").textContent);
  var canvas = document.getElementById("tl-canvas");
  var panel = document.getElementById("tl-panel-body");
  var crumbs = document.getElementById("tl-crumbs");
  var search = document.getElementById("tl-search");
  var results = document.getElementById("tl-results");
  var upButton = document.getElementById("tl-up");
  var state = { view: -1, svg: null, box: null, full: null, selected: null, shown: null };

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // ----- pictures ------------------------------------------------------------------------------
  function openView(index) {
    if (index === state.view) return;
    var source = document.getElementById("tl-view-" + index);
    canvas.innerHTML = source.textContent;
    var svg = canvas.querySelector("svg");
    svg.removeAttribute("width");
    svg.removeAttribute("height");
    svg.setAttribute("preserveAspectRatio", "xMidYMid meet");
    var vb = svg.getAttribute("viewBox").split(/[\s,]+/).map(Number);
    state.view = index;
    state.svg = svg;
    state.full = { x: vb[0], y: vb[1], w: vb[2], h: vb[3] };
    state.selected = null;
    fit();
    drawCrumbs();
    upButton.disabled = data.views[index].parent === null;
    markMatches(search.value);
    if (state.shown) showRecord(state.shown);
  }

  function drawCrumbs() {
    crumbs.textContent = "";
    var view = data.views[state.view];
    var root = el("a", "tl-crumb", data.model);
    root.href = "#";
    crumbs.appendChild(root);
    view.crumb.forEach(function (key) {
      crumbs.appendChild(el("span", "tl-sep", "\u203a"));
      var link = el("a", "tl-crumb", data.titles[key]);
      link.href = "#";
      link.dataset.key = key;
      crumbs.appendChild(link);
    });
  }

  crumbs.addEventListener("click", function (event) {
    var link = event.target.closest("a.tl-crumb");
    if (!link) return;
    event.preventDefault();
    var key = link.dataset.key;
    if (!key) openView(0);
    // A module with a picture of its own opens it; one drawn expanded in an outer picture is shown there.
    else if (data.opens[key] !== undefined) openView(data.opens[key]);
    else select(key, true);
  });

  function goUp() {
    var view = data.views[state.view];
    if (view.parent === null) return;
    var focus = view.focus;
    openView(view.parent);
    if (focus) select(focus, true);
  }
  upButton.addEventListener("click", goUp);

  // ----- pan and zoom --------------------------------------------------------------------------
  function setBox(box) {
    state.box = box;
    state.svg.setAttribute("viewBox", [box.x, box.y, box.w, box.h].join(" "));
  }

  // SVG units per screen pixel past which 10-point labels are too small to read.
  var READABLE = 1.5;

  function wholeBox() {
    var f = state.full;
    var pad = Math.max(f.w, f.h) * 0.02;
    return { x: f.x - pad, y: f.y - pad, w: f.w + 2 * pad, h: f.h + 2 * pad };
  }

  function fitWhole() {
    setBox(wholeBox());
  }

  function fit() {
    // The whole picture when it is readable so; a tall one is fitted to its width (a wide one to its
    // height) from its start, never smaller than READABLE nor larger than 1:1.
    var whole = wholeBox();
    var rect = canvas.getBoundingClientRect();
    if (!rect.width || !rect.height) return setBox(whole);
    var sw = whole.w / rect.width, sh = whole.h / rect.height;
    if (Math.max(sw, sh) <= READABLE) return setBox(whole);
    var tall = sh >= sw;
    var s = Math.min(READABLE, Math.max(1, tall ? sw : sh));
    var w = rect.width * s, h = rect.height * s;
    var f = state.full, margin = 10;
    setBox({ x: tall ? f.x + (f.w - w) / 2 : f.x - margin, y: tall ? f.y - margin : f.y + (f.h - h) / 2,
             w: w, h: h });
  }
  document.getElementById("tl-fit").addEventListener("click", fit);

  function scale() {
    // SVG units per screen pixel under preserveAspectRatio="meet".
    var rect = canvas.getBoundingClientRect();
    return Math.max(state.box.w / rect.width, state.box.h / rect.height);
  }

  function toGraph(clientX, clientY) {
    var rect = canvas.getBoundingClientRect();
    var s = scale();
    var cx = state.box.x + state.box.w / 2, cy = state.box.y + state.box.h / 2;
    return { x: cx + (clientX - rect.left - rect.width / 2) * s, y: cy + (clientY - rect.top - rect.height / 2) * s };
  }

  canvas.addEventListener("wheel", function (event) {
    if (!state.svg) return;
    event.preventDefault();
    var factor = Math.exp(event.deltaY * 0.0015);
    var at = toGraph(event.clientX, event.clientY);
    var b = state.box;
    var w = Math.min(Math.max(b.w * factor, 5), state.full.w * 20);
    var k = w / b.w;
    setBox({ x: at.x - (at.x - b.x) * k, y: at.y - (at.y - b.y) * k, w: w, h: b.h * k });
  }, { passive: false });

  var drag = null;
  canvas.addEventListener("pointerdown", function (event) {
    results.hidden = true;
    if (event.button !== 0 || !state.svg) return;
    drag = { x: event.clientX, y: event.clientY, box: state.box, moved: false };
  });
  window.addEventListener("pointermove", function (event) {
    if (!drag) return;
    var dx = event.clientX - drag.x, dy = event.clientY - drag.y;
    if (!drag.moved && Math.abs(dx) + Math.abs(dy) < 4) return;
    if (!drag.moved) canvas.setPointerCapture && canvas.setPointerCapture(event.pointerId);
    drag.moved = true;
    var s = scale();
    setBox({ x: drag.box.x - dx * s, y: drag.box.y - dy * s, w: drag.box.w, h: drag.box.h });
  });
  window.addEventListener("pointerup", function () {
    if (drag && drag.moved) canvas.dataset.dragged = "1";
    drag = null;
  });

  function centerOn(node) {
    var bb = node.getBBox();
    var b = state.box;
    var w = Math.min(b.w, Math.max(bb.width * 6, 400));
    var h = b.h * (w / b.w);
    // Graphviz draws inside a translated group; getCTM maps its coordinates to the SVG's own.
    var m = node.getCTM(), root = state.svg.getCTM();
    var x = bb.x + bb.width / 2, y = bb.y + bb.height / 2;
    if (m && root) {
      var p = state.svg.createSVGPoint();
      p.x = x; p.y = y;
      p = p.matrixTransform(root.inverse().multiply(m));
      x = p.x; y = p.y;
    }
    setBox({ x: x - w / 2, y: y - h / 2, w: w, h: h });
  }

  // ----- selection and records -----------------------------------------------------------------
  function nodeElement(key) {
    key = (data.alias && data.alias[key]) || key;  // an output drawn as a port of its call's node
    return state.svg && (document.getElementById(key) || document.getElementById("c" + key));
  }

  function select(key, center) {
    var where = data.where[key];
    if (where === undefined) return false;
    if (where !== state.view) openView(where);
    var old = canvas.querySelectorAll(".tl-hit");
    for (var i = 0; i < old.length; i++) old[i].classList.remove("tl-hit");
    var node = nodeElement(key);
    if (node) {
      node.classList.add("tl-hit");
      if (center) centerOn(node);
    }
    state.selected = key;
    showRecord(key);
    return true;
  }

  function addRow(list, name, value) {
    if (value === undefined || value === null || value === "") return;
    list.appendChild(el("dt", null, name));
    var dd = el("dd");
    if (Array.isArray(value)) {
      value.forEach(function (v) { dd.appendChild(el("div", null, String(v))); });
    } else if (typeof value === "object") {
      dd.textContent = Object.keys(value).map(function (k) { return k + " " + value[k]; }).join(", ");
    } else {
      dd.textContent = String(value);
    }
    list.appendChild(dd);
  }

  var FIELDS = [["kind", "kind"], ["class", "class"], ["function", "function"], ["type", "type"],
    ["pass", "pass"], ["passes", "passes"], ["path", "path"], ["shape", "shape"], ["dtype", "dtype"],
    ["device", "device"], ["memory", "output bytes"], ["modules", "module stack"], ["source", "source"],
    ["code", "code"], ["params", "params"], ["duration", "duration"], ["device_time", "device time"],
    ["cpu_time", "self CPU time"], ["flops", "FLOPs"],
    ["grad_fn", "grad_fn"], ["inplace", "in place"], ["intervention", "changed by"], ["activation", "activation"],
    ["original", "original"], ["gradient", "gradient"],
    ["finite", "non-finite"],
    ["calls", "calls"], ["depth", "depth"], ["ops", "ops inside"], ["inputs", "inputs"], ["outputs", "outputs"],
    ["parents", "parents"], ["outside", "from outside"], ["children", "children"]];

  function showRecord(key) {
    var rec = data.items[key] || data.groups[key];
    state.shown = key;
    panel.textContent = "";
    if (!rec) return;
    panel.appendChild(el("h2", "tl-record-title", rec.label));
    var list = el("dl", "tl-record");
    FIELDS.forEach(function (f) { addRow(list, f[1], rec[f[0]]); });
    panel.appendChild(list);
    if (data.opens[key] !== undefined && data.opens[key] !== state.view) {
      var open = el("button", "tl-open", "Open module");
      open.type = "button";
      open.addEventListener("click", function () { openView(data.opens[key]); });
      panel.appendChild(open);
    }
  }

  canvas.addEventListener("click", function (event) {
    if (canvas.dataset.dragged) { delete canvas.dataset.dragged; return; }
    var node = event.target.closest("g.node, g.cluster");
    if (!node) return;
    var key = node.classList.contains("cluster") ? node.id.slice(1) : node.id;
    if (node.classList.contains("tl-ref")) key = key.slice(1);  // a reference: go to the real node
    select(key, node.classList.contains("tl-ref"));
  });

  canvas.addEventListener("dblclick", function (event) {
    var node = event.target.closest("g.tl-module");
    if (node && data.opens[node.id] !== undefined) openView(data.opens[node.id]);
  });

  // ----- search --------------------------------------------------------------------------------
  function matches(query) {
    var q = query.trim().toLowerCase();
    if (!q) return [];
    var exact = [], partial = [];
    for (var i = 0; i < data.search.length; i++) {
      var label = data.search[i][0].toLowerCase();
      if (label === q || label === q + ":1") exact.push(data.search[i]);
      else if (label.indexOf(q) >= 0) partial.push(data.search[i]);
    }
    return exact.concat(partial);
  }

  function markMatches(query) {
    if (!state.svg) return;
    var old = canvas.querySelectorAll(".tl-match");
    for (var i = 0; i < old.length; i++) old[i].classList.remove("tl-match");
    matches(query).forEach(function (m) {
      var node = data.where[m[1]] === state.view ? nodeElement(m[1]) : null;
      if (node) node.classList.add("tl-match");
    });
  }

  function listResults(found) {
    results.textContent = "";
    found.slice(0, 40).forEach(function (m) {
      var li = el("li", null, m[0]);
      li.dataset.key = m[1];
      results.appendChild(li);
    });
    if (found.length > 40) results.appendChild(el("li", "tl-more", (found.length - 40) + " more"));
    results.hidden = found.length === 0;
  }

  var pending = null;
  search.addEventListener("input", function () {
    clearTimeout(pending);
    pending = setTimeout(function () {
      listResults(matches(search.value));
      markMatches(search.value);
    }, 80);
  });
  search.addEventListener("keydown", function (event) {
    if (event.key === "Enter") {
      clearTimeout(pending);
      var found = matches(search.value);
      if (found.length) select(found[0][1], true);
      markMatches(search.value);
      results.hidden = true;
    } else if (event.key === "Escape") {
      search.value = "";
      results.hidden = true;
      markMatches("");
    }
  });
  results.addEventListener("click", function (event) {
    var li = event.target.closest("li");
    if (!li || !li.dataset.key) return;
    select(li.dataset.key, true);
    markMatches(search.value);
    results.hidden = true;
  });

  document.addEventListener("keydown", function (event) {
    if (event.target === search) return;
    if (event.key === "/") { event.preventDefault(); search.focus(); }
    else if (event.key === "f") fit();
    else if (event.key === "w") fitWhole();
    else if (event.key === "u" || event.key === "Backspace") goUp();
  });

  window.addEventListener("error", function (event) {
    document.documentElement.dataset.tlError = String(event.message);
  });

  openView(0);
  document.documentElement.dataset.tlReady = String(Math.round(performance.now()));
})();
