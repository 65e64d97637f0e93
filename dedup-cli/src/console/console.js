// dedup console: our own few lines; nothing is loaded from anywhere else.
(function () {
  "use strict";

  // The overview refreshes itself without reloading the page: 5 seconds
  // after the previous refresh answered (a slow one is never overlapped).
  var part = document.querySelector("[data-refresh]");
  if (part && window.fetch) {
    var url = part.getAttribute("data-refresh");
    var next = function () {
      setTimeout(refresh, 5000);
    };
    var refresh = function () {
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
        })
        .then(next);
    };
    next();
  }

  // A form that changes something is sent once: its buttons are disabled
  // as it goes (a double click sends one release, one replay).
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (form.getAttribute("method") !== "post") {
      return;
    }
    if (form.getAttribute("data-sent")) {
      event.preventDefault();
      return;
    }
    form.setAttribute("data-sent", "yes");
    setTimeout(function () {
      var buttons = form.querySelectorAll("button");
      for (var i = 0; i < buttons.length; i++) {
        buttons[i].disabled = true;
      }
    }, 0);
  });
})();
