/* Display equations a little wider than the column are set smaller until they fit it.

MathJax 3 does not break a display equation into lines; one wider than the text column
scrolls sideways inside it (custom.css), which hides its end from a reader. An equation
that fits at no less than SMALLEST of MathJax's size (MathJax sets math at about 127% of
the text, so 0.7 of it is about 14 px for 16 px text and its subscripts stay near 10 px)
is shrunk to fit; a wider one keeps its size, scrolls, and is marked `math-scrolls` so
custom.css shows that it does (such an equation should be broken into lines in its
chapter). Runs once MathJax has typeset the page, and again whenever an equation's box
changes width (window resized, a collapsed section opened).
*/
(function () {
  "use strict";
  var SMALLEST = 0.7;
  var DISPLAY = 'mjx-container[display="true"]';
  var fittedWidth = new WeakMap();

  function fit(eq) {
    var width = eq.clientWidth;
    if (!width) return;  // hidden (a collapsed cell): fitted when it is shown
    fittedWidth.set(eq, width);
    if (eq.dataset.fontSize === undefined) eq.dataset.fontSize = eq.style.fontSize || "";
    var original = eq.dataset.fontSize;
    eq.style.fontSize = original;
    eq.classList.remove("math-shrunk", "math-scrolls");
    if (eq.scrollWidth <= width + 1) return;
    var base = parseFloat(original) || 100;  // MathJax's percentage of the text size
    var scale = width / eq.scrollWidth;
    if (scale < SMALLEST) {
      eq.classList.add("math-scrolls");
      return;
    }
    // the box's padding does not scale with the font: step down until it fits
    for (var i = 0; i < 4 && eq.scrollWidth > width + 1 && scale >= SMALLEST; i++) {
      eq.style.fontSize = (base * scale).toFixed(2) + "%";
      scale *= Math.min(0.995, width / eq.scrollWidth);
    }
    if (eq.scrollWidth > width + 1) {
      eq.style.fontSize = original;
      eq.classList.add("math-scrolls");
    } else {
      eq.classList.add("math-shrunk");
    }
  }

  function fitAll() {
    var equations = document.querySelectorAll(DISPLAY);
    equations.forEach(fit);
    if (!window.ResizeObserver) return;
    var observer = new ResizeObserver(function (entries) {
      entries.forEach(function (entry) {
        var eq = entry.target;
        if (eq.clientWidth && eq.clientWidth !== fittedWidth.get(eq)) fit(eq);
      });
    });
    equations.forEach(function (eq) { observer.observe(eq); });
  }

  function start() {
    var mj = window.MathJax;
    if (mj && mj.startup && mj.startup.promise) {
      mj.startup.promise.then(fitAll, fitAll);
    } else if (document.querySelector(DISPLAY)) {
      fitAll();
    }
  }

  // MathJax's script is deferred: by the load event it has started, or is not on the page
  if (document.readyState === "complete") start();
  else window.addEventListener("load", start);
})();
