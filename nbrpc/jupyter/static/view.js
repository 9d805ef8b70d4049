// The one front end of nbrpc's widgets (anywidget ES module, no build step, no CDN).
//
// Python renders every view as SVG/HTML (the same markup is the widget's static
// repr); this module shows it and sends the person's actions back:
//   traits  title, status, html, panel (strings), controls (buttons and
//           toggles), filters ({group: [values]}: checkboxes that hide marks
//           whose data-f-<group> lists an unchecked value)
//   sends   {event: "control", id, value}   a button pressed or a toggle changed
//           {event: "select", key}          a mark with data-key clicked
function el(tag, attrs = {}, text = "") {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text) e.textContent = text;
  return e;
}

function render({ model, el: root }) {
  root.classList.add("nbrpc-view");
  const head = el("div", { class: "nbrpc-head" });
  const title = el("span", { class: "nbrpc-title" });
  const controls = el("span", { class: "nbrpc-controls" });
  head.append(title, controls);
  const filters = el("div", { class: "nbrpc-filters" });
  const body = el("div", { class: "nbrpc-body" });
  const main = el("div", { class: "nbrpc-main" });
  const panel = el("div", { class: "nbrpc-panel" });
  body.append(main, panel);
  const status = el("div", { class: "nbrpc-status" });
  root.append(head, filters, body, status);
  const hidden = {};  // group -> Set of unchecked values (kept across redraws)

  function applyFilters() {
    for (const mark of main.querySelectorAll("[data-f]")) {
      let show = true;
      for (const group of mark.getAttribute("data-f").split(" ")) {
        const values = (mark.getAttribute("data-f-" + group) || "").split(" ");
        if (hidden[group] && values.some((v) => hidden[group].has(v))) show = false;
      }
      mark.style.display = show ? "" : "none";
    }
  }

  function drawControls() {
    controls.replaceChildren();
    for (const c of model.get("controls") || []) {
      if (c.kind === "toggle") {
        const label = el("label", { class: "nbrpc-toggle", title: c.title || "" });
        const box = el("input", { type: "checkbox", "data-id": c.id });
        box.checked = !!c.value;
        box.addEventListener("change", () =>
          model.send({ event: "control", id: c.id, value: box.checked }));
        label.append(box, document.createTextNode(" " + c.label));
        controls.append(label);
      } else {
        const b = el("button", { class: "nbrpc-button", "data-id": c.id, title: c.title || "" },
          c.label);
        b.disabled = !!c.disabled;
        b.addEventListener("click", () => model.send({ event: "control", id: c.id }));
        controls.append(b);
      }
    }
  }

  function drawFilters() {
    filters.replaceChildren();
    for (const [group, values] of Object.entries(model.get("filters") || {})) {
      if (!values.length) continue;
      hidden[group] = hidden[group] || new Set();
      const row = el("span", { class: "nbrpc-filter", "data-group": group });
      row.append(el("b", {}, group + ":"));
      for (const v of values) {
        const label = el("label");
        const box = el("input", { type: "checkbox", "data-value": v });
        box.checked = !hidden[group].has(v);
        box.addEventListener("change", () => {
          if (box.checked) hidden[group].delete(v); else hidden[group].add(v);
          applyFilters();
        });
        label.append(box, document.createTextNode(" " + v));
        row.append(label);
      }
      filters.append(row);
    }
  }

  function drawMain() {
    const t0 = performance.now();
    main.innerHTML = model.get("html");
    applyFilters();
    root.dataset.renderMs = (performance.now() - t0).toFixed(1);
  }

  main.addEventListener("click", (ev) => {
    const mark = ev.target.closest("[data-key]");
    if (!mark || !main.contains(mark)) return;
    for (const m of main.querySelectorAll(".nbrpc-selected")) m.classList.remove("nbrpc-selected");
    mark.classList.add("nbrpc-selected");
    model.send({ event: "select", key: mark.getAttribute("data-key") });
  });

  const drawTitle = () => { title.textContent = model.get("title"); };
  const drawStatus = () => { status.textContent = model.get("status"); };
  const drawPanel = () => {
    panel.innerHTML = model.get("panel");
    panel.style.display = model.get("panel") ? "" : "none";
  };
  drawTitle(); drawControls(); drawFilters(); drawMain(); drawPanel(); drawStatus();
  model.on("change:title", drawTitle);
  model.on("change:controls", drawControls);
  model.on("change:filters", () => { drawFilters(); applyFilters(); });
  model.on("change:html", drawMain);
  model.on("change:panel", drawPanel);
  model.on("change:status", drawStatus);
}

export default { render };
