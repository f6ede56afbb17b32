// A tiny line plot in SVG: one polyline per series, min/max labels. No dependencies,
// nothing fetched at run time (the status page must work offline).
"use strict";
const MeshPlot = {
  colours: ["#06c", "#c60", "#080", "#a0a", "#c00", "#088"],
  draw(series, width, height) {
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("class", "plot");
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    const pad = 4;
    let names = Object.keys(series).filter((k) => series[k].length > 0);
    names.forEach((name, i) => {
      const points = series[name];
      const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
      const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
      const sx = (x) => pad + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (width - 2 * pad);
      const sy = (y) => height - pad - (y1 === y0 ? 0.5 : (y - y0) / (y1 - y0)) * (height - 2 * pad);
      const line = document.createElementNS(ns, "polyline");
      line.setAttribute("points", points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "));
      line.setAttribute("stroke", MeshPlot.colours[i % MeshPlot.colours.length]);
      line.setAttribute("data-series", name);
      line.setAttribute("data-points", String(points.length));
      const title = document.createElementNS(ns, "title");
      title.textContent = `${name}: ${ys[ys.length - 1]} (round ${xs[xs.length - 1]})`;
      line.appendChild(title);
      svg.appendChild(line);
    });
    return svg;
  },
};
