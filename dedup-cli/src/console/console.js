// dedup console: the overview refreshes itself without reloading the page.
// Our own few lines; nothing is loaded from anywhere else.
(function () {
  "use strict";
  var part = document.querySelector("[data-refresh]");
  if (!part || !window.fetch) {
    return;
  }
  var url = part.getAttribute("data-refresh");
  setInterval(function () {
    fetch(url, { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        return response.ok ? response.text() : null;
      })
      .then(function (html) {
        if (html !== null) {
          // Server-rendered and escaped by the console, as the page was.
          part.innerHTML = html;
          part.setAttribute("data-refreshed", String(Date.now()));
        }
      })
      .catch(function () {
        // The console is restarting: the next tick tries again.
      });
  }, 5000);
})();
