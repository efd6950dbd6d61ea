/*
 * The pod sandbox ("pause") process of the real node's pods. No registry is
 * reachable from these machines, so the node cannot pull registry.k8s.io/pause;
 * this is the same idea in a few lines, built static (scripts/images.sh) and
 * shipped as a one-file scratch image.
 *
 * It holds the pod's namespaces open: it blocks until SIGTERM or SIGINT (then
 * exits 0), and as PID 1 of a shared PID namespace it reaps orphaned
 * children so they do not stay zombies.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) {
    (void)sig;
    _exit(0);
}

static void on_chld(int sig) {
    (void)sig;
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("remora-pause");
        return 0;
    }
    if (getpid() != 1) {
        fputs("remora-pause: warning: not PID 1\n", stderr);
    }
    struct sigaction term = {.sa_handler = on_term};
    sigemptyset(&term.sa_mask);
    if (sigaction(SIGINT, &term, NULL) < 0 || sigaction(SIGTERM, &term, NULL) < 0) {
        return 1;
    }
    struct sigaction chld = {.sa_handler = on_chld, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    sigemptyset(&chld.sa_mask);
    if (sigaction(SIGCHLD, &chld, NULL) < 0) {
        return 2;
    }
    for (;;) {
        pause();
    }
    /* not reached */
    return 42;
}
