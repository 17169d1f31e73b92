/* The pod sandbox's process ("pause"): PID 1 of every pod on the dev cluster's real node.
 * It holds the pod's namespaces open, reaps zombies and exits on SIGINT or SIGTERM. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signum) { (void)signum; _exit(0); }

static void reap(int signum) {
  (void)signum;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction action = {0};
  action.sa_handler = stop;
  sigaction(SIGINT, &action, NULL);
  sigaction(SIGTERM, &action, NULL);
  action.sa_handler = reap;
  action.sa_flags = SA_NOCLDSTOP;
  sigaction(SIGCHLD, &action, NULL);
  for (;;) pause();
}
